"""The properties of the kinds called on a RolloutBatch: advantage, critic_target,
rollout_correction (an estimate [B, T]), position_mask ([B, T] in {0, 1}), prompt_weight
([B], one weight per prompt) and truncation (a new batch).

Imports torch and hypothesis: imported only when a check runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch import Tensor

from ppokit.batch import FIELDS, RolloutBatch
from ppokit.testing.inputs import (
    FLOAT_FIELDS,
    Violation,
    batch_fields,
    close,
    first_bad,
    number,
    shape_of,
)
from ppokit.testing.strategies import batches

__all__ = ["batch_properties"]

Call = Callable[[RolloutBatch], Any]

#: The fields the ``requires`` property keeps: the two every batch has, and the two that
#: ``batch.terminal_values`` reads, set by the spec's truncation rule (convention 2).
ALWAYS = ("response_mask", "token_rewards", "truncated", "bootstrap_values")

#: What a per-token output is; a prompt weight is per row.
PER_TOKEN = ("estimate", "position_mask")


def _output(returns: str, out: Any) -> Tensor:
    """The tensor a property compares: the output, or a truncation rule's rewards under its
    mask (what the trainer reads of the new batch)."""
    if returns == "batch":
        if not isinstance(out, RolloutBatch):
            raise Violation(f"returned a {type(out).__name__}, not a RolloutBatch")
        return torch.where(out.response_mask, out.token_rewards.float(), 0.0)
    if not isinstance(out, Tensor):
        raise Violation(f"returned a {type(out).__name__}, not a tensor")
    return out


def _contract(returns: str) -> Callable[[Call, RolloutBatch], None]:
    def test(call: Call, batch: RolloutBatch) -> None:
        mask = batch.response_mask
        out = call(batch)
        if returns == "batch":
            _batch_contract(batch, out)
            return
        if not isinstance(out, Tensor):
            raise Violation(f"returned a {type(out).__name__}, not a tensor")
        shape = tuple(mask.shape[:1]) if returns == "prompt_weight" else tuple(mask.shape)
        dtypes = (torch.float32, torch.bool) if returns == "position_mask" else (torch.float32,)
        if tuple(out.shape) != shape or out.dtype not in dtypes:
            want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise Violation(
                f"returned {str(out.dtype).removeprefix('torch.')} {shape_of(out)}, "
                f"expected {want} {list(shape)}"
            )
        if out.requires_grad:
            raise Violation("returned a tensor that requires grad (an estimate is detached)")
        bad = ~torch.isfinite(out.float())
        if bool(bad.any()):
            i = first_bad(bad)
            raise Violation(f"non-finite output at {list(i)}: {number(out[i].item())}")
        if returns == "position_mask":
            bad = (out.float() != 0) & (out.float() != 1)
            if bool(bad.any()):
                i = first_bad(bad)
                raise Violation(f"output at {list(i)} is {number(out[i].item())}, not 0 or 1")

    return test


def _batch_contract(batch: RolloutBatch, out: Any) -> None:
    """A truncation rule: a batch of the same shape, its mask inside the input's, the other
    tensors (the policy's and the critic's) left as they were."""
    if not isinstance(out, RolloutBatch):
        raise Violation(f"returned a {type(out).__name__}, not a RolloutBatch")
    if out.response_mask.shape != batch.response_mask.shape:
        raise Violation(f"returned a batch of shape {shape_of(out.response_mask)}")
    grown = out.response_mask & ~batch.response_mask
    if bool(grown.any()):
        raise Violation(f"its mask is True at padded position {list(first_bad(grown))}")
    if out.token_rewards.dtype != batch.token_rewards.dtype:
        raise Violation(f"token_rewards became {out.token_rewards.dtype}")
    for field in ("values", "logp_old", "logp_rollout", "logp_ref", "group_ids", "truncated"):
        before, after = getattr(batch, field), getattr(out, field)
        if before is not None and (after is None or not torch.equal(after, before)):
            raise Violation(f"changed {field}")
    bad = ~torch.isfinite(out.token_rewards.float())
    if bool(bad.any()):
        raise Violation(f"non-finite token_rewards at {list(first_bad(bad))}")


def _masked_zero(returns: str) -> Callable[[Call, RolloutBatch], None]:
    def test(call: Call, batch: RolloutBatch) -> None:
        out = _output(returns, call(batch))
        where = ~batch.response_mask if returns in PER_TOKEN else ~batch.nonempty
        bad = where & (out != 0)
        if bool(bad.any()):
            i = first_bad(bad)
            what = "padded position" if returns in PER_TOKEN else "empty row"
            raise Violation(f"output at {what} {list(i)} is {number(out[i].item())}, not 0")

    return test


def _noise(batch: RolloutBatch, seed: int) -> RolloutBatch:
    """The batch with other values at its padded positions of every [B, T] float field."""
    gen = torch.Generator().manual_seed(seed)
    mask = batch.response_mask
    changed = {}
    for i, field in enumerate(FLOAT_FIELDS):
        x = getattr(batch, field)
        if x is not None:
            noise = (torch.randn(mask.shape, generator=gen) * 100 + 7 * (i + 1)).to(x.dtype)
            changed[field] = torch.where(mask, x, noise)
    return batch.replace(**changed)


def _widen(batch: RolloutBatch, extra: int) -> RolloutBatch:
    """The batch with ``extra`` padded columns appended (mask False, values nonzero)."""
    fields = batch_fields(batch)
    b = batch.batch_size
    for field, x in list(fields.items()):
        if (
            x.dim() == 2
            and x.shape[1] == batch.response_mask.shape[1]
            and field
            in {
                "response_mask",
                "env_mask",
                *FLOAT_FIELDS,
            }
        ):
            fill = False if x.dtype == torch.bool else -3.0
            fields[field] = torch.cat([x, torch.full((b, extra), fill, dtype=x.dtype)], dim=1)
    return RolloutBatch(**fields)


def _padding(returns: str) -> Callable[[Call, tuple[RolloutBatch, int, int]], None]:
    def test(call: Call, case: tuple[RolloutBatch, int, int]) -> None:
        batch, seed, extra = case
        mask = batch.response_mask
        real: Tensor | None = mask if returns in PER_TOKEN else batch.nonempty
        if returns == "batch":
            real = None
        out = _output(returns, call(batch))
        noisy = _output(returns, call(_noise(batch, seed)))
        close(noisy, out, real, "with other values at the padded positions, the output")
        wide = _output(returns, call(_widen(batch, extra)))
        if returns in PER_TOKEN or returns == "batch":
            wide = wide[:, : mask.shape[1]]
        close(wide, out, real, f"with {extra} padded columns appended, the output")

    return test


def _empty_rows(returns: str) -> Callable[[Call, tuple[RolloutBatch, int, int]], None]:
    def test(call: Call, case: tuple[RolloutBatch, int, int]) -> None:
        batch, which, extra = case
        b, t = batch.response_mask.shape
        added = batch.rows(torch.full((extra,), which % b))
        added = added.replace(
            response_mask=torch.zeros(extra, t, dtype=torch.bool),
            token_rewards=(torch.arange(extra * t).reshape(extra, t) % 5 + 3.0).to(
                batch.token_rewards.dtype
            ),
        )
        fields = {f: torch.cat([x, getattr(added, f)]) for f, x in batch_fields(batch).items()}
        out = _output(returns, call(batch))
        grown = _output(returns, call(RolloutBatch(**fields)))
        real = None if returns == "prompt_weight" else batch.response_mask
        close(grown[:b], out, real, f"with {extra} empty rows appended, the output")
        bad = grown[b:] != 0
        if bool(bad.any()):
            i = first_bad(bad)
            raise Violation(
                f"appended empty row {b + i[0]} has output {number(grown[b + i[0]].flatten()[i[-1]].item())}, not 0"
            )

    return test


def _row_order(returns: str) -> Callable[[Call, tuple[RolloutBatch, int]], None]:
    def test(call: Call, case: tuple[RolloutBatch, int]) -> None:
        batch, seed = case
        perm = torch.from_numpy(np.random.default_rng(seed).permutation(batch.batch_size))
        out = _output(returns, call(batch))
        moved = _output(returns, call(batch.rows(perm)))
        real = None if returns == "prompt_weight" else batch.response_mask[perm]
        close(moved, out[perm], real, f"with the rows in the order {perm.tolist()}, the output")

    return test


def _requires(returns: str, requires: tuple[str, ...]) -> Callable[[Call, RolloutBatch], None]:
    def test(call: Call, batch: RolloutBatch) -> None:
        out = _output(returns, call(batch))
        kept = {*ALWAYS, *requires}
        bare = RolloutBatch(**{f: x for f, x in batch_fields(batch).items() if f in kept})
        try:
            less = _output(returns, call(bare))
        except Violation:
            raise
        except Exception as exc:
            from ppokit.errors import one_line

            undeclared = sorted(f for f in FIELDS if f not in kept)
            raise Violation(
                f"without the fields it does not require ({', '.join(undeclared)}) it raised "
                f"{one_line(exc)}"
            ) from None
        real = None if returns == "prompt_weight" else batch.response_mask
        close(less, out, real, "without the fields it does not require, the output")

    return test


def _per_group(call: Call, batch: RolloutBatch) -> None:
    w = _output("prompt_weight", call(batch)).float()
    live = batch.nonempty
    mean = batch.group_mean(w, weights=live.float())
    close(w, mean, live, "the weight (against its group's mean)")


def batch_properties(
    returns: str, requires: tuple[str, ...]
) -> list[tuple[str, str, Any, Callable[..., None]]]:
    """(name, meaning, inputs, test) of each property of a kind called on a batch."""
    f32 = batches(dtype=torch.float32)
    seeds = st.integers(0, 2**31 - 1)
    per_token = returns in PER_TOKEN
    props: list[tuple[str, str, Any, Callable[..., None]]] = [
        ("contract", "shape, dtype, detached, finite", batches(), _contract(returns)),
    ]
    if returns != "batch":
        where = "padded positions" if per_token else "empty rows"
        props.append(("masked_zero", f"0 at {where}", f32, _masked_zero(returns)))
    props += [
        (
            "padding",
            "values at padded positions and appended padded columns change nothing",
            st.tuples(f32, seeds, st.integers(1, 3)),
            _padding(returns),
        ),
        (
            "row_order",
            "reordering the rows reorders the output",
            st.tuples(f32, seeds),
            _row_order(returns),
        ),
        (
            "requires",
            "the batch fields it does not declare in `requires` change nothing",
            f32,
            _requires(returns, requires),
        ),
    ]
    if returns != "batch":
        props.insert(
            3,
            (
                "empty_rows",
                "appended empty rows (all masked) change no other row and get 0",
                st.tuples(f32, st.integers(0, 11), st.integers(1, 3)),
                _empty_rows(returns),
            ),
        )
    if returns == "prompt_weight" and "truncated" not in requires:
        # a weight that reads a response's own field (truncated) is one a response, by design
        props.append(
            ("per_group", "one weight per prompt (equal across its group)", f32, _per_group)
        )
    return props


def describe_batch_case(case: Any) -> str:
    from ppokit.testing.inputs import batch_text

    batch = case[0] if isinstance(case, tuple) else case
    return batch_text(batch)
