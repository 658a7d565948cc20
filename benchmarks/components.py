"""Benchmark of the advantage estimators and critic targets.

For each component and shape: the median time of the component, of a direct per-step Python
loop over t implementing the same formula (vectorised over B; group estimators: a loop over
groups), and of copying the tensors the component reads once (``clone()``). Prints ms and the
ratios loop/ours and ours/copy. With ``--compile`` a last column times the same component
under ``torch.compile`` (compiled once before timing).

    python benchmarks/components.py [--quick] [--repeats N] [--shape BxT ...] [--only NAME ...]
                                    [--device cpu|cuda] [--compile]

The timings of a row are interleaved (ours, copy, loop, compiled in each round, after a
warm-up round), so that load from other processes hits them alike; each is the median over
the rounds. Within a round, ours, the copy and the compiled call are each timed on their
second of two calls in a row, so both find the inputs in cache (as a component does in a round, right after the
scoring passes wrote them) and neither inherits the cache the other left behind. ``--quick`` runs only the smallest shape; ``--shape`` replaces the default shapes;
``--only`` keeps the components whose name (``gae`` or ``advantage.gae``) is given. On CUDA
every timing is bracketed by ``torch.cuda.synchronize()``. At T = 32768 the loop is timed on
the first ``LOOP_SLICE`` positions and scaled linearly in T (marked ``*`` in the table).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.registry import get_registry

SHAPES = ((64, 1024), (256, 4096), (64, 32768))
LOOP_SLICE = 4096


# ----------------------------------------------------------------------------- loops
def _zeros(batch: RolloutBatch) -> Tensor:
    return torch.zeros(batch.batch_size, batch.seq_len, device=batch.device)


def _masked(batch: RolloutBatch, x: Tensor | None) -> Tensor:
    assert x is not None
    return torch.where(batch.response_mask, x.float(), 0.0)


def loop_scan(x: Tensor, mask: Tensor, discount: float | Tensor, init: Tensor) -> Tensor:
    """y_t = x_t + d * y_next over True positions, one Python step per t."""
    out = torch.zeros_like(x)
    acc = init.clone()
    for t in range(x.shape[1] - 1, -1, -1):
        m = mask[:, t]
        acc = torch.where(m, x[:, t] + discount * acc, acc)
        out[:, t] = torch.where(m, acc, 0.0)
    return out


def loop_gae(batch: RolloutBatch, gamma: float, lam: float | Tensor) -> Tensor:
    mask = batch.response_mask
    r, v = _masked(batch, batch.token_rewards), _masked(batch, batch.values)
    out = _zeros(batch)
    v_next = batch.terminal_values.clone()
    acc = torch.zeros(batch.batch_size, device=batch.device)
    for t in range(batch.seq_len - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * v_next - v[:, t]
        acc = torch.where(m, delta + gamma * lam * acc, acc)
        v_next = torch.where(m, v[:, t], v_next)
        out[:, t] = torch.where(m, acc, 0.0)
    return out


def loop_returns(batch: RolloutBatch, gamma: float, bootstrap: bool) -> Tensor:
    init = (
        batch.terminal_values if bootstrap else torch.zeros(batch.batch_size, device=batch.device)
    )
    return loop_scan(_masked(batch, batch.token_rewards), batch.response_mask, gamma, init)


def loop_td0(batch: RolloutBatch, gamma: float) -> Tensor:
    mask = batch.response_mask
    r, v = _masked(batch, batch.token_rewards), _masked(batch, batch.values)
    out = _zeros(batch)
    v_next = batch.terminal_values.clone()
    for t in range(batch.seq_len - 1, -1, -1):
        m = mask[:, t]
        out[:, t] = torch.where(m, r[:, t] + gamma * v_next, 0.0)
        v_next = torch.where(m, v[:, t], v_next)
    return out


def whiten(x: Tensor, mask: Tensor) -> Tensor:
    sel = x[mask]
    return torch.where(mask, (x - sel.mean()) / torch.sqrt(sel.var() + 1e-8), 0.0)


def loop_groups(batch: RolloutBatch, fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Per-row advantage from a Python loop over groups, broadcast over the row."""
    scores = batch.scores
    assert batch.group_ids is not None
    adv = torch.zeros_like(scores)
    for g in batch.group_ids.unique().tolist():
        rows = batch.group_ids == g
        adv[rows] = fn(scores[rows], batch.lengths[rows].float())
    return torch.where(batch.response_mask, adv[:, None], 0.0)


def _centred(s: Tensor, _: Tensor) -> Tensor:
    return s - s.mean() if len(s) > 1 else s


def _grpo(s: Tensor, _: Tensor) -> Tensor:
    return (s - s.mean()) / (s.std() + 1e-6) if len(s) > 1 else s / (1 + 1e-6)


def _rloo(s: Tensor, _: Tensor) -> Tensor:
    return (s - (s.sum() - s) / (len(s) - 1)) if len(s) > 1 else s


def _opo(s: Tensor, lengths: Tensor) -> Tensor:
    return s - (lengths * s).sum() / lengths.sum() if len(s) > 1 else s


def _lengths_lam(batch: RolloutBatch) -> Tensor:
    return (1 - 1 / (0.05 * batch.lengths.float())).clamp(0, 1)


def _baseline(batch: RolloutBatch) -> Tensor:
    assert batch.baseline_rewards is not None
    return batch.baseline_rewards.float()[:, None]


LOOPS: dict[tuple[str, str], Callable[[RolloutBatch], Tensor]] = {
    ("advantage", "gae"): lambda b: whiten(loop_gae(b, 1.0, 0.95), b.response_mask),
    ("advantage", "mc"): lambda b: torch.where(
        b.response_mask, loop_returns(b, 1.0, True) - _masked(b, b.values), 0.0
    ),
    ("advantage", "length_adaptive_gae"): lambda b: whiten(
        loop_gae(b, 1.0, _lengths_lam(b)), b.response_mask
    ),
    ("advantage", "grpo"): lambda b: loop_groups(b, _grpo),
    ("advantage", "dr_grpo"): lambda b: loop_groups(b, _centred),
    ("advantage", "rloo"): lambda b: loop_groups(b, _rloo),
    ("advantage", "reinforce_pp"): lambda b: whiten(loop_returns(b, 1.0, False), b.response_mask),
    ("advantage", "reinforce_pp_baseline"): lambda b: whiten(
        loop_groups(b, _centred), b.response_mask
    ),
    ("advantage", "remax"): lambda b: torch.where(
        b.response_mask, loop_returns(b, 1.0, False) - _baseline(b), 0.0
    ),
    ("advantage", "opo"): lambda b: loop_groups(b, _opo),
    ("critic_target", "lambda_return"): lambda b: torch.where(
        b.response_mask, loop_gae(b, 1.0, 1.0) + _masked(b, b.values), 0.0
    ),
    ("critic_target", "mc_return"): lambda b: loop_returns(b, 1.0, True),
    ("critic_target", "td0"): lambda b: loop_td0(b, 1.0),
}

#: Whether the loop walks over t (sliced and scaled at long T) or over groups.
TIME_LOOPS = {key for key in LOOPS if key[1] not in {"grpo", "dr_grpo", "rloo", "opo"}} - {
    ("advantage", "reinforce_pp_baseline")
}


# ----------------------------------------------------------------------------- timing
def make_batch(b: int, t: int, seed: int = 0, device: str = "cpu") -> RolloutBatch:
    """Ragged rows (lengths in [T/2, T]), 10% masked gaps, groups of 8, some truncated."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 2, t + 1, (b, 1), generator=gen)
    mask = torch.arange(t)[None, :] < lengths
    mask &= torch.rand(b, t, generator=gen) > 0.1
    batch = RolloutBatch(
        response_mask=mask,
        token_rewards=torch.randn(b, t, generator=gen),
        values=torch.randn(b, t, generator=gen),
        group_ids=torch.arange(b) // 8,
        truncated=torch.rand(b, generator=gen) < 0.2,
        bootstrap_values=torch.randn(b, generator=gen),
        baseline_rewards=torch.randn(b, generator=gen),
    )
    return batch.to(device)


class Timer:
    """Wall-clock seconds of a call, synchronising the device around it on CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def interleaved_ms(
    fns: list[Callable[[], object]],
    repeats: list[int],
    timer: Timer,
    warm: list[bool] | None = None,
) -> list[float]:
    """Median ms of each function; one warm-up round, then rounds that run each in turn.

    ``repeats[i]``: timed runs of ``fns[i]`` (a function stops once it has its count);
    ``warm[i]``: an untimed call of ``fns[i]`` right before each timed one.
    """
    warm = warm or [False] * len(fns)
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(max(repeats)):
        for fn, want, acc, twice in zip(fns, repeats, times, warm, strict=True):
            if round_ < want:
                if twice:
                    fn()
                acc.append(timer(fn))
    return [1e3 * statistics.median(acc) for acc in times]


def read_fields(kind: str, name: str) -> tuple[str, ...]:
    requires = get_registry().info(kind, name).requires
    return ("response_mask", "token_rewards", *requires)


@dataclass
class Row:
    component: str
    shape: tuple[int, int]
    ours: float
    loop: float
    copy: float
    scaled: bool
    compiled: float | None = None


def bench(
    kind: str, name: str, batch: RolloutBatch, repeats: int, timer: Timer, compile: bool = False
) -> Row:
    component = get_registry().create(kind, name)
    fields = [getattr(batch, f) for f in read_fields(kind, name)]
    loop_fn = LOOPS[(kind, name)]
    t = batch.seq_len
    scaled = (kind, name) in TIME_LOOPS and t > LOOP_SLICE
    part = batch
    if scaled:
        part = batch.replace(**{f: getattr(batch, f)[:, :LOOP_SLICE] for f in _token_fields(batch)})
    loop_repeats = max(3, repeats // 3) if (kind, name) in TIME_LOOPS else repeats

    fns = [
        lambda: component(batch.replace()),
        lambda: [f.clone() for f in fields],
        lambda: loop_fn(part.replace()),
    ]
    counts, warm = [repeats, repeats, loop_repeats], [True, True, False]
    if compile:
        compiled = torch.compile(component, dynamic=False)
        compiled(batch.replace())  # compile before timing
        fns = [*fns, lambda: compiled(batch.replace())]
        counts, warm = [*counts, repeats], [*warm, True]
    ours, copy, loop, *rest = interleaved_ms(fns, counts, timer, warm=warm)
    if scaled:
        loop *= t / LOOP_SLICE
    shape = tuple(batch.response_mask.shape)
    return Row(f"{kind}.{name}", shape, ours, loop, copy, scaled, rest[0] if compile else None)


def _token_fields(batch: RolloutBatch) -> list[str]:
    return [
        f
        for f in ("response_mask", "token_rewards", "values", "logp_old", "logp_ref")
        if batch.has(f)
    ]


def _shape(text: str) -> tuple[int, int]:
    b, t = text.lower().split("x")
    return int(b), int(t)


def _selected(kind: str, name: str, only: list[str] | None) -> bool:
    return not only or name in only or f"{kind}.{name}" in only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the smallest shape")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per measurement")
    parser.add_argument(
        "--shape", type=_shape, action="append", help="B x T to run, e.g. 256x4096 (repeatable)"
    )
    parser.add_argument(
        "--only", action="append", help="component name, e.g. gae or critic_target.td0"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    args = parser.parse_args()
    if args.repeats < 7:
        parser.error("--repeats must be at least 7")
    shapes = args.shape or (SHAPES[:1] if args.quick else SHAPES)
    keys = [key for key in LOOPS if _selected(*key, args.only)]
    if not keys:
        parser.error(f"--only matches no component of {[n for _, n in LOOPS]}")
    timer = Timer(args.device)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
        f"median of {args.repeats} interleaved runs"
    )
    header = f"{'component':<38}{'B x T':>12}{'ours ms':>10}{'loop ms':>11}{'copy ms':>9}"
    print(
        header
        + f"{'loop/ours':>11}{'ours/copy':>11}"
        + (f"{'compiled':>10}" if args.compile else "")
    )
    for b, t in shapes:
        batch = make_batch(b, t, device=args.device)
        for kind, name in keys:
            row = bench(kind, name, batch, args.repeats, timer, args.compile)
            mark = "*" if row.scaled else " "
            print(
                f"{row.component:<38}{f'{b}x{t}':>12}{row.ours:>10.2f}{row.loop:>10.1f}{mark}"
                f"{row.copy:>9.2f}{row.loop / row.ours:>11.1f}{row.ours / row.copy:>11.2f}"
                + ("" if row.compiled is None else f"{row.compiled:>10.2f}"),
                flush=True,
            )
    print(f"* loop timed on the first {LOOP_SLICE} positions and scaled linearly in T")


if __name__ == "__main__":
    main()
