"""The properties of the kinds called on tensors: the elementwise ones (policy_loss with its
mask; kl_estimator and regression_loss without one, which leave masking to the
aggregation), aggregation (a scalar) and group_filter (one flag per group).

Imports torch and hypothesis: imported only when a check runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch import Tensor

from ppokit.components.group_filter import Groups
from ppokit.testing.inputs import (
    Args,
    Violation,
    close,
    elementwise_args,
    first_bad,
    mask_text,
    number,
    shape_of,
)
from ppokit.testing.strategies import group_sets

__all__ = ["aggregation_properties", "elementwise_properties", "group_filter_properties"]
__all__ += ["shuffled_groups"]

Property = tuple[str, str, Any, Callable[..., None]]
SEEDS = st.integers(0, 2**31 - 1)


class Elementwise:
    """Calls a component of an elementwise kind with :class:`Args`: the regression loss's
    ``pred`` read from its head output through its optional members, as the trainer does."""

    def __init__(self, component: Any, names: tuple[str, ...], diff: str) -> None:
        self.component, self.names, self.diff = component, names, diff

    def __call__(self, args: Args, grad: bool = False) -> tuple[Tensor, Tensor | None]:
        values = dict(args.values)
        source = "head" if "head" in values else self.diff
        x = values[source].detach().float().requires_grad_(True) if grad else values[source]
        values[source] = x
        if "head" in values:
            head = values.pop("head")
            read = getattr(self.component, "prediction", None)
            value = getattr(self.component, "value", None)
            if read is not None:
                values["pred"] = read(head)
            else:
                values["pred"] = value(head) if value is not None else head[..., 0]
        out = self.component(*(values[n] for n in self.names))
        if not isinstance(out, Tensor):
            raise Violation(f"returned a {type(out).__name__}, not a tensor")
        return out, x if grad else None


def _check_finite(out: Tensor, what: str = "output") -> None:
    bad = ~torch.isfinite(out.detach().float())
    if bool(bad.any()):
        i = first_bad(bad)
        raise Violation(f"non-finite {what} at {list(i)}: {number(out[i].item())}")


def _elementwise_contract(call: Elementwise, args: Args) -> None:
    out, _ = call(args)
    shape = args.shape
    if tuple(out.shape) != shape or out.dtype != torch.float32:
        dtype = str(out.dtype).removeprefix("torch.")
        raise Violation(f"returned {dtype} {shape_of(out)}, expected float32 {list(shape)}")
    _check_finite(out)
    out, _ = call(args, grad=True)
    if not out.requires_grad:
        raise Violation(f"returned a tensor without grad: it is differentiable in {call.diff}")


def _masked_zero(call: Elementwise, args: Args) -> None:
    out, _ = call(args)
    assert args.mask is not None
    bad = ~args.mask & (out != 0)
    if bool(bad.any()):
        i = first_bad(bad)
        raise Violation(f"output at padded position {list(i)} is {number(out[i].item())}, not 0")


def _changed(args: Args, where: Tensor, seed: int) -> Args:
    """Other values (some far out) where ``where`` is True, in every float argument."""
    gen = torch.Generator().manual_seed(seed)

    def swap(name: str, x: Tensor) -> Tensor:
        if name == "mask":
            return x
        noise = torch.randn(x.shape, generator=gen) * 20 + 5
        if name.startswith("logp"):
            noise = -noise.abs()
        w = where if x.dim() == 2 else where[..., None]
        return torch.where(w, noise.to(x.dtype), x)

    return args.map(swap)


def _widened(args: Args, extra: int) -> Args:
    def widen(name: str, x: Tensor) -> Tensor:
        shape = (x.shape[0], extra, *x.shape[2:])
        fill = False if x.dtype == torch.bool else (-2.0 if name.startswith("logp") else 3.0)
        return torch.cat([x, torch.full(shape, fill, dtype=x.dtype)], dim=1)

    return args.map(widen)


def _padding(call: Elementwise, case: tuple[Args, int, int]) -> None:
    """Masked: what padded positions hold changes no real one. Without a mask: each
    position's output depends on that position's inputs only."""
    args, seed, extra = case
    out, _ = call(args)
    b, t = args.shape
    if args.mask is not None:
        where, real = ~args.mask, args.mask
        what = "with other values at the padded positions, the output"
    else:
        where = torch.from_numpy(np.random.default_rng(seed).random((b, t)) < 0.5)
        real = ~where
        what = f"with other values at the positions {mask_text(where)}, the output"
    close(call(_changed(args, where, seed))[0], out, real, what)
    wide, _ = call(_widened(args, extra))
    close(wide[:, :t], out, args.mask, f"with {extra} padded columns appended, the output")


def _gradient(call: Elementwise, case: tuple[Args, int]) -> None:
    """d(Σ w·out)/d(input) is finite, and 0 at padded positions (with a mask) or at the
    positions whose outputs w does not weigh (without one)."""
    args, seed = case
    out, x = call(args, grad=True)
    assert x is not None
    b, t = args.shape
    rng = np.random.default_rng(seed)
    weights = torch.from_numpy(rng.standard_normal((b, t)).astype(np.float32))
    if args.mask is not None:
        zero = ~args.mask
    else:
        zero = torch.from_numpy(rng.random((b, t)) < 0.5)
        weights = torch.where(zero, 0.0, weights)
    if not out.requires_grad:
        raise Violation(f"returned a tensor without grad: it is differentiable in {call.diff}")
    (grad,) = torch.autograd.grad((out.float() * weights).sum(), x, allow_unused=True)
    if grad is None:
        return
    _check_finite(grad, "gradient")
    per_position = grad.abs().reshape(b, t, -1).amax(dim=2)
    bad = zero & (per_position != 0)
    if bool(bad.any()):
        i = first_bad(bad)
        where = "padded position" if args.mask is not None else "unweighted position"
        raise Violation(f"gradient at {where} {list(i)} is {number(per_position[i].item())}")


def elementwise_properties(names: tuple[str, ...], head_size: int) -> list[Property]:
    """(name, meaning, inputs, test) of each property of an elementwise kind."""
    f32 = elementwise_args(names, head_size=head_size, dtype=torch.float32)
    masked = "mask" in names
    props: list[Property] = [
        (
            "contract",
            "shaped like its argument, float32, finite, differentiable",
            elementwise_args(names, head_size=head_size),
            _elementwise_contract,
        )
    ]
    if masked:
        props.append(("masked_zero", "0 at padded positions", f32, _masked_zero))
    meaning = (
        "values at padded positions and appended padded columns change nothing"
        if masked
        else "each position's output depends on that position's inputs only"
    )
    props.append(("padding", meaning, st.tuples(f32, SEEDS, st.integers(1, 3)), _padding))
    props.append(
        ("gradient", "finite, 0 at positions that cannot matter", st.tuples(f32, SEEDS), _gradient)
    )
    return props


# ---------------------------------------------------------------------- aggregation
def _agg_contract(agg: Any, args: Args) -> None:
    values, mask = args.values["values"], args.values["mask"]
    out = agg(values, mask)
    if not isinstance(out, Tensor) or out.dim() != 0 or out.dtype != torch.float32:
        got = f"{out.dtype} {shape_of(out)}" if isinstance(out, Tensor) else type(out).__name__
        raise Violation(f"returned {got}, expected a float32 scalar")
    _check_finite(out)
    if not agg(values.float().requires_grad_(True), mask).requires_grad:
        raise Violation("returned a scalar without grad: it is differentiable in its values")
    empty = torch.zeros_like(mask)
    nothing = agg(torch.full(values.shape, float("nan")), empty)
    if not bool(nothing == 0):
        raise Violation(f"an all-masked input aggregates to {number(float(nothing))}, not 0")


def _agg_padding(agg: Any, case: tuple[Args, int, int]) -> None:
    """NaN and inf at padded positions change nothing; appended padded columns change
    nothing for a given denominator (the denominator itself may read T)."""
    args, seed, extra = case
    values, mask = args.values["values"], args.values["mask"]
    out = agg(values, mask)
    pool = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    garbage = pool[(torch.arange(values.numel()) + seed) % 4].reshape(values.shape)
    close(
        agg(torch.where(mask, values, garbage), mask),
        out,
        None,
        "with NaN and inf at the padded positions, the output",
    )
    wide = _widened(args, extra)
    fn = getattr(agg, "denominator", None)
    denom = fn(mask) if fn is not None else None
    kwargs = {} if denom is None else {"denom": denom}
    got = agg(wide.values["values"], wide.values["mask"], **kwargs)
    close(
        got, agg(values, mask, **kwargs), None, f"with {extra} padded columns appended, the output"
    )


def _agg_gradient(agg: Any, args: Args) -> None:
    values, mask = args.values["values"], args.values["mask"]
    x = values.float().requires_grad_(True)
    (grad,) = torch.autograd.grad(agg(x, mask), x)
    _check_finite(grad, "gradient")
    bad = ~mask & (grad != 0)
    if bool(bad.any()):
        i = first_bad(bad)
        raise Violation(f"gradient at padded position {list(i)} is {number(grad[i].item())}")


def _micro_batches(agg: Any, case: tuple[Args, list[int]]) -> None:
    """Σ over a row split of agg(part, mask_part, denom=denominator(whole)) is agg(whole)."""
    args, cuts = case
    values, mask = args.values["values"], args.values["mask"]
    b = values.shape[0]
    bounds = [0, *sorted({c for c in cuts if 0 < c < b}), b]
    denom = agg.denominator(mask)
    parts = [agg(values[lo:hi], mask[lo:hi], denom=denom) for lo, hi in itertools.pairwise(bounds)]
    close(sum(parts), agg(values, mask), None, f"summed over the row split {bounds}, the output")


def aggregation_properties(has_denominator: bool) -> list[Property] | Any:
    f32 = elementwise_args(("values", "mask"), dtype=torch.float32)
    props: list[Property | tuple[str, str]] = [
        (
            "contract",
            "a float32 scalar, finite, differentiable; 0 when all is masked",
            elementwise_args(("values", "mask")),
            _agg_contract,
        ),
        (
            "padding",
            "NaN at padded positions and appended padded columns change nothing",
            st.tuples(f32, SEEDS, st.integers(1, 3)),
            _agg_padding,
        ),
        ("gradient", "finite, 0 at padded positions", f32, _agg_gradient),
    ]
    meaning = "micro-batches with the whole denominator sum to the whole"
    if has_denominator:
        cuts = st.lists(st.integers(1, 5), max_size=4)
        props.append(("micro_batches", meaning, st.tuples(f32, cuts), _micro_batches))
    else:
        props.append(("micro_batches", "it declares no denominator"))
    return props


# ---------------------------------------------------------------------- group filter
def _filter_contract(keep: Any, groups: Groups) -> None:
    out = keep(groups)
    if not isinstance(out, Tensor) or out.dtype != torch.bool or tuple(out.shape) != (groups.size,):
        got = f"{out.dtype} {shape_of(out)}" if isinstance(out, Tensor) else type(out).__name__
        raise Violation(f"returned {got}, expected bool [{groups.size}]")


def shuffled_groups(groups: Groups, seed: int) -> tuple[Groups, Tensor]:
    """``groups`` with the responses shuffled inside each group and the groups themselves
    shuffled (seeded), and the groups' new order (group i of the result is ``order[i]``)."""
    gen = torch.Generator().manual_seed(seed)
    g, n = groups.rewards.shape
    inside = torch.argsort(torch.rand(g, n, generator=gen), dim=1)
    order = torch.randperm(g, generator=gen)
    shuffled = Groups(
        rows=[groups.rows[i] for i in order.tolist()],
        responses=groups.responses,
        rewards=groups.rewards.gather(1, inside)[order],
        lengths=groups.lengths.gather(1, inside)[order],
        truncated=groups.truncated.gather(1, inside)[order],
    )
    return shuffled, order


def _group_order(keep: Any, case: tuple[Groups, int]) -> None:
    groups, seed = case
    shuffled, order = shuffled_groups(groups, seed)
    out, moved = keep(groups), keep(shuffled)
    if not torch.equal(moved, out[order]):
        i = first_bad(moved != out[order])[0]
        raise Violation(
            f"with the groups in the order {order.tolist()} (and responses shuffled inside), "
            f"group {int(order[i])}'s flag changed to {bool(moved[i])}"
        )


def group_filter_properties() -> list[Property]:
    return [
        ("contract", "bool [G]", group_sets(), _filter_contract),
        (
            "group_order",
            "reordering groups or their responses reorders the flags",
            st.tuples(group_sets(), SEEDS),
            _group_order,
        ),
    ]


def describe_args(case: Any) -> str:
    first = case[0] if isinstance(case, tuple) else case
    if isinstance(first, Args):
        return first.text()
    if isinstance(first, Groups):
        g, n = first.rewards.shape
        rewards = (
            "[" + " ".join(",".join(number(v) for v in row) for row in first.rewards.tolist()) + "]"
        )
        return f"G={g} n={n} rewards={rewards}"
    return ""
