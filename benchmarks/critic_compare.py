"""The demo task with two critic losses: ``clipped_mse`` against ``hlgauss``.

Both runs use ``examples/specs/ppo_hlgauss.yaml`` (the demo spec with an HL-Gauss critic);
the ``clipped_mse`` run overrides only ``critic.loss``, so everything else is identical. For
each loss and seed it reports:

- ``ev_last20`` / ``ev_all``: explained variance of the critic, 1 - Var[Y - V] / Var[Y] over
  the response tokens of a round (metric ``explained_variance``, measured on each round's
  fresh rollouts before the update; comparable across losses), averaged over the last 20
  rounds and over all rounds (rounds where Var[Y] = 0 have none and are skipped);
- ``ev_med20``: its median over the last 20 rounds. Once the policy has converged Var[Y] is
  tiny, so a tiny error gives a large negative value in such a round: the mean is dominated
  by those rounds, the median is not;
- ``ev_wtd``: the rounds' explained variances pooled with weights s_r^2 (s_r = the round's
  ``reward_std``), 1 - sum_r s_r^2 (1 - EV_r) / sum_r s_r^2: approximately
  1 - sum_r Var_r[Y - V] / sum_r Var_r[Y], taking a round's Var[Y] proportional to the
  variance of its scores;
- ``abs_err`` / ``rmse``: the final critic's value error mean |Y - V| and sqrt(mean (Y - V)^2)
  over the response tokens of ``--eval-rounds`` fresh rounds, sampled after training from the
  final checkpoint (policy and critic as trained, no update);
- ``reward_last5``: mean reward of the last 5 training rounds;
- ``wall_s``: training time, the sum of the rounds' ``time_round`` (noisy on a loaded machine).

    python benchmarks/critic_compare.py [--seeds 0 1 2] [--rounds N] [--eval-rounds 4]
                                        [--json PATH] [--keep DIR [--reuse]]

``--keep DIR`` writes the runs into DIR instead of a temporary folder; with ``--reuse`` a run
whose DIR already holds its final checkpoint is read instead of trained again (the figures
are the same: the value error is measured from the checkpoint, RNG state included).

Needs the plugin: ``pip install ./plugins/ppokit-hlgauss``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ppokit.spec import Spec, load_spec
from ppokit.trainer import train

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "specs" / "ppo_hlgauss.yaml"
#: Overrides of each compared critic loss (the spec's own loss is hlgauss).
LOSSES: dict[str, tuple[str, ...]] = {
    "clipped_mse": ("critic.loss=clipped_mse",),
    "hlgauss": (),
}
FIGURES = ("ev_last20", "ev_med20", "ev_all", "ev_wtd", "abs_err", "rmse", "reward_last5", "wall_s")


@dataclass(frozen=True)
class RunResult:
    """The figures of one training run."""

    loss: str
    seed: int
    ev_last20: float
    ev_med20: float
    ev_all: float
    ev_wtd: float
    abs_err: float
    rmse: float
    reward_last5: float
    wall_s: float


def _mean(values: Sequence[float | None]) -> float:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else math.nan


def _median(values: Sequence[float | None]) -> float:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else math.nan


def pooled_ev(history: Sequence[dict[str, Any]]) -> float:
    """1 - sum_r s_r^2 (1 - EV_r) / sum_r s_r^2 over the rounds that report both figures."""
    pairs = [
        (h["reward_std"] ** 2, h["explained_variance"])
        for h in history
        if h.get("reward_std") is not None and h.get("explained_variance") is not None
    ]
    total = sum(w for w, _ in pairs)
    if total <= 0:
        return math.nan
    return 1.0 - sum(w * (1.0 - ev) for w, ev in pairs) / total


def finished(out: Path, rounds: int) -> bool:
    """Whether ``out`` holds a run's final checkpoint."""
    state = out / "checkpoint" / "state.json"
    return state.is_file() and json.loads(state.read_text()).get("round") == rounds


def value_error(spec: Spec, out: Path, rounds: int) -> tuple[float, float]:
    """(mean |Y - V|, sqrt(mean (Y - V)^2)) of the run's final checkpoint on fresh rollouts."""
    from ppokit.data import make_prompt_source
    from ppokit.trainer.checkpoint import load_checkpoint
    from ppokit.trainer.prompts import format_prompts
    from ppokit.trainer.round import run_round
    from ppokit.trainer.run import build

    run = build(spec, threads=False)
    setup, state, models = run.setup, run.state, run.setup.models
    source = make_prompt_source(spec.data, spec.seed)
    load_checkpoint(out, models, state, source)
    abs_sum = torch.zeros((), dtype=torch.float64)
    sq_sum = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for r in range(rounds):  # steps 1-4 of a round: the values and their targets
            rows = source.next_rows(spec.rollout.prompts_per_round)
            formatted = format_prompts(rows, models.tokenizer, spec.data)
            data = run_round(setup, state, rows, formatted, round_no=r + 1, update=False).data
            assert data.targets is not None and data.batch.values is not None
            mask = data.batch.maskf.double()
            diff = (data.targets.double() - data.batch.values.double()) * mask
            abs_sum += diff.abs().sum().cpu()
            sq_sum += diff.square().sum().cpu()
            count += mask.sum().cpu()
    n = count.clamp_min(1.0)
    return float(abs_sum / n), float((sq_sum / n).sqrt())


def run_one(
    loss: str, seed: int, base: Path, rounds: int | None, eval_rounds: int, reuse: bool = False
) -> RunResult:
    out = base / f"{loss}-seed{seed}"
    overrides = [
        *LOSSES[loss],
        f"seed={seed}",
        f"output.dir={out}",
        "output.progress=false",
    ]
    if rounds is not None:
        overrides.append(f"train.rounds={rounds}")
    spec = load_spec(SPEC, overrides=overrides)
    if not (reuse and finished(out, spec.train.rounds)):
        train(spec, overwrite=True)
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ev = [h.get("explained_variance") for h in history]
    abs_err, rmse = value_error(spec, out, eval_rounds)
    return RunResult(
        loss=loss,
        seed=seed,
        ev_last20=_mean(ev[-20:]),
        ev_med20=_median(ev[-20:]),
        ev_all=_mean(ev),
        ev_wtd=pooled_ev(history),
        abs_err=abs_err,
        rmse=rmse,
        reward_last5=_mean([h.get("reward_mean") for h in history[-5:]]),
        wall_s=sum(h.get("time_round") or 0.0 for h in history),
    )


def _num(fig: str, value: float) -> str:
    return f"{value:.1f}" if fig == "wall_s" else f"{value:.4f}"


def _cell(fig: str, values: Sequence[float]) -> str:
    if len(values) < 2:
        return _num(fig, values[0])
    return f"{_num(fig, statistics.fmean(values))} ± {_num(fig, statistics.stdev(values))}"


def table(results: Sequence[RunResult]) -> str:
    """Markdown: the mean ± sd over seeds per loss, side by side, then one row per run."""
    losses = list(dict.fromkeys(r.loss for r in results))
    seeds = sorted({r.seed for r in results})
    lines = [
        f"Mean ± sd over seeds {', '.join(map(str, seeds))}:",
        "",
        "| figure | " + " | ".join(losses) + " |",
        "|---|" + "---|" * len(losses),
    ]
    for fig in FIGURES:
        cells = [
            _cell(fig, [getattr(r, fig) for r in results if r.loss == loss]) for loss in losses
        ]
        lines.append(f"| {fig} | " + " | ".join(cells) + " |")
    lines += ["", "Per run:", "", "| loss | seed | " + " | ".join(FIGURES) + " |"]
    lines.append("|---|---|" + "---|" * len(FIGURES))
    for r in results:
        cells = [_num(fig, getattr(r, fig)) for fig in FIGURES]
        lines.append(f"| {r.loss} | {r.seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=None, help="default: the spec's rounds")
    parser.add_argument("--eval-rounds", type=int, default=4, help="rounds of value error")
    parser.add_argument("--json", type=Path, default=None, help="also write the runs as JSON")
    parser.add_argument("--keep", type=Path, default=None, help="write the runs here")
    parser.add_argument(
        "--reuse", action="store_true", help="with --keep: read finished runs, do not retrain"
    )
    args = parser.parse_args()
    if args.reuse and args.keep is None:
        parser.error("--reuse needs --keep DIR")
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="ppokit-critic-") as tmp:
        base = args.keep or Path(tmp)
        for seed in args.seeds:
            for loss in LOSSES:
                result = run_one(loss, seed, base, args.rounds, args.eval_rounds, args.reuse)
                print(json.dumps(asdict(result)), flush=True)
                results.append(result)
    print()
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")


if __name__ == "__main__":
    main()
