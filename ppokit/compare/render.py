"""summary.md, summary.json and compare.png from a summary. Torch-free (matplotlib Agg)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ppokit.compare.runs import PLOT, SUMMARY_JSON, SUMMARY_MD
from ppokit.compare.summary import RunRecord, is_number, signs_text, summarize, trim
from ppokit.metrics_table import REWARD, ROUND, THROUGHPUT, metric
from ppokit.runfolder import (
    write_atomic,
)
from ppokit.stats import mean_ci95

#: The line styles of the arms, in turn (solid, dashed, dotted, dash-dot, dash-dot-dot).
LINE_STYLES: tuple[Any, ...] = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))


def fmt(x: float | None, digits: int = 3) -> str:
    """A number for a table: ``-`` when missing, ``digits`` significant digits."""
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.{digits}g}" if abs(x) >= 1 else f"{x:.{digits}f}"


def fmt_stat(stat: Mapping[str, Any]) -> str:
    """``mean ± ci95`` of a summary statistic (``(n=1)`` for one run, ``-`` for none)."""
    if stat["mean"] is None:
        return "-"
    if stat["ci95"] is None:
        return f"{fmt(stat['mean'])} (n=1)"
    return f"{fmt(stat['mean'])} ± {fmt(stat['ci95'])}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(summary: Mapping[str, Any], title: str = "ppokit compare") -> str:
    """summary.md: one row per spec, then one row per run."""
    thr = summary["threshold"]
    evals = summary["eval_metrics"]
    head = [
        "spec",
        "differs in",
        "runs (finished/failed/total)",
        "final reward",
        *evals,
        f"rounds to reward ≥ {thr:g} (reached)",
        "wall time s",
        "tokens/s",
        "health signs (runs)",
    ]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in summary["specs"]:
        rt = g["rounds_to_threshold"]
        differs = ", ".join(f"{k}={v}" for k, v in g["differs"].items()) or "-"
        row = [
            g["name"],
            differs,
            f"{g['finished']}/{g['failed']}/{g['runs_total']}",
            fmt_stat(g["final_reward"]),
            *(fmt_stat(g["eval"][k]) for k in evals),
            f"{fmt(rt['mean'])} ({rt['reached']}/{rt['of']})",
            fmt_stat(g["wall_time_s"]),
            fmt_stat(g[THROUGHPUT]),
            signs_text(g.get("signs", {}), g["finished"]),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    lines += [
        "",
        f"final reward: each run's mean `reward_mean` over its last {summary['final_window']} "
        "rounds; mean over the spec's finished runs (seeds) ± the half-width of the two-sided "
        "95% Student-t confidence interval (n=1: a single run, no interval). `eval/...` "
        "columns likewise (a metric logged in none of the last rounds: its last value). "
        f"rounds to reward ≥ {thr:g}: the first round whose `reward_mean` reaches it, mean over "
        "the runs that reached it (how many of the finished runs did). wall time: Σ "
        "`time_round` of a run; tokens/s: a run's mean `tokens_per_s`; both mean ± 95% CI over "
        "runs. health signs: each sign of docs/health.md that fired in a finished run, and in "
        "how many (its rounds: the run's `metrics.jsonl`, `health/<sign>`).",
        "",
        "## Runs",
        "",
        "| spec | seed | status | rounds | final reward | wall time s | health signs | error "
        "| folder |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in summary["specs"]:
        for r in g["runs"]:
            row = [
                g["name"],
                "-" if r["seed"] is None else str(r["seed"]),
                r["status"],
                str(r.get("rounds", 0)),
                fmt(r.get("final_reward")),
                fmt(r.get("wall_time_s")),
                ", ".join(r.get("signs", [])) or "-",
                r["error"] or "",
                r["dir"],
            ]
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def _curve(
    runs: Sequence[RunRecord], key: str
) -> tuple[list[int], list[float], list[float], list[float], list[int]]:
    """Per round: the mean of ``key`` over the runs, the band drawn around it and the number
    of runs it rests on. The band is the 95% CI of the mean clipped to the range the runs'
    values cover at that round: with few seeds the t-interval is wider than anything any seed
    reached (with 2, always: t_{0.975,1} = 12.7), and a band beyond the seeds' values (or
    beyond a metric's range, rewards in [0, 1]) shows nothing that happened. One run: no band
    (the band is its value)."""
    by_round: dict[int, list[float]] = {}
    for r in runs:
        for h in trim(r.history, r.rounds):
            if is_number(h.get(key)):
                by_round.setdefault(h[ROUND], []).append(float(h[key]))
    xs = sorted(by_round)
    means, lows, highs, counts = [], [], [], []
    for x in xs:
        values = by_round[x]
        mean, half = mean_ci95(values)
        half = half if math.isfinite(half) else 0.0
        means.append(mean)
        lows.append(max(mean - half, min(values)))
        highs.append(min(mean + half, max(values)))
        counts.append(len(values))
    return xs, means, lows, highs, counts


def _seeds(counts: Sequence[int]) -> str:
    """``3 seeds``, ``1 seed``, or ``2-3 seeds`` where rounds rest on different numbers."""
    lo, hi = min(counts), max(counts)
    n = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return f"{n} seed" if hi == 1 else f"{n} seeds"


def figure(
    records: Sequence[RunRecord],
    summary: Mapping[str, Any],
    title: str = "",
    keys: Sequence[str] | None = None,
) -> Any:
    """compare.png's figure: reward_mean against the round, per spec the mean over its
    finished runs with a shaded band (the 95% CI clipped to the seeds' values, see
    :func:`_curve`), one colour per spec, labelled with the number of seeds it rests on; a
    second panel for an eval metric when any run logs one. None when there is nothing to
    plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    finished = [r for r in records if r.status == "finished" and r.history]
    if not finished:
        return None
    keys = list(keys) if keys else [REWARD, *summary["eval_metrics"][:1]]
    n_specs = len(summary["specs"])
    fig = Figure(figsize=(7 * len(keys), 4.5 + 0.22 * n_specs))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    colours: list[Any] = [f"C{i}" for i in range(n_specs)]
    if n_specs > 10:  # ten colours repeat: take twenty
        from matplotlib import colormaps

        colours = [colormaps["tab20"](i % 20) for i in range(n_specs)]
    # a line style as well as a colour: arms whose curves overlap stay apart
    styles = [LINE_STYLES[i % len(LINE_STYLES)] for i in range(n_specs)]
    for ax, key in zip(axes, keys, strict=True):
        for colour, style, g in zip(colours, styles, summary["specs"], strict=True):
            runs = [r for r in finished if r.group == g["name"]]
            xs, means, lows, highs, counts = _curve(runs, key)
            if not xs:
                continue
            ax.plot(
                xs,
                means,
                color=colour,
                linestyle=style,
                linewidth=1.5,
                marker="." if len(xs) <= 30 else None,
                label=f"{g['label']} ({_seeds(counts)})",
            )
            ax.fill_between(xs, lows, highs, color=colour, alpha=0.2, linewidth=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(metric(ROUND).label)
        ax.set_ylabel(metric(key).label)
        ax.set_title(f"{key}: mean over seeds, shaded 95% CI within the seeds' range", fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.suptitle(title or "ppokit compare")
    fig.legend(handles, labels, loc="lower center", fontsize=8, ncol=1, frameon=False)
    fig.tight_layout(rect=(0, 0.22 * n_specs / (4.5 + 0.22 * n_specs) + 0.02, 1, 1))
    return fig


def plot(
    records: Sequence[RunRecord],
    summary: Mapping[str, Any],
    path: Path,
    title: str = "",
    keys: Sequence[str] | None = None,
) -> bool:
    """Write compare.png (:func:`figure`, of ``keys``: default the reward and the first eval
    metric) to ``path``. Returns False when there is nothing to plot."""
    fig = figure(records, summary, title, keys)
    if fig is None:
        return False
    write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=100))
    return True


def write_outputs(
    out: Path,
    records: Sequence[RunRecord],
    threshold: float,
    order: Sequence[str] | None = None,
    specs: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Write summary.json, summary.md and compare.png into ``out``; returns the summary."""
    summary = summarize(records, threshold, order, specs)
    text = json.dumps(_json_safe(summary), indent=2) + "\n"
    write_atomic(out / SUMMARY_JSON, text)
    write_atomic(out / SUMMARY_MD, render_markdown(summary))
    n = max((g["runs_total"] for g in summary["specs"]), default=0)
    plot(records, summary, out / PLOT, title=f"ppokit compare: {out.name} (up to {n} seed(s))")
    return summary


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
