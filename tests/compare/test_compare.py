"""``ppokit compare``: seeds, planning of run folders, labels, the summary statistics, the
user errors, a sweep with a stand-in trainer (failure, interruption, threads) and one with
real tiny runs (summary, plot, --report, skip of finished runs, resume, a failing run)."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ppokit.children import python_command
from ppokit.compare import (
    RunRecord,
    SweepRun,
    compare_command,
    component_names,
    differing_components,
    parse_seeds,
    plan_run,
    prepare_specs,
    report,
    run_status,
    run_sweep,
    spec_labels,
    threads_per_job,
    train_command,
)
from ppokit.compare import progress as cmp_progress
from ppokit.compare import render as cmp_render
from ppokit.compare import runs as cmp_runs
from ppokit.compare.summary import summarize
from ppokit.errors import UserError
from ppokit.spec import SpecError, load_spec
from ppokit.stats import mean_ci95
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("clean_registry")

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command("compare")(compare_command)


@app.command("noop")
def _noop() -> None:
    """A second command, so that 'compare' stays a subcommand."""


runner = CliRunner()

TINY = {
    "model": {"actor": "tiny"},
    "data": {"source": "demo"},
    "rollout": {"prompts_per_round": 4, "n": 2, "max_new_tokens": 4},
    "train": {"rounds": 3},
    "output": {"progress": False},
}


def write_spec(directory: Path, name: str, **extra: Any) -> Path:
    data = {**TINY, **extra}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def invoke(*args: str) -> Any:
    return runner.invoke(app, ["compare", *args], catch_exceptions=False)


def assert_user_error(result: Any, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output + result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------- pure functions
def test_parse_seeds() -> None:
    assert parse_seeds("3") == [3]
    assert parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("0,2,5") == [0, 2, 5]
    assert parse_seeds(" 0-2, 7 ,1") == [0, 1, 2, 7]
    assert parse_seeds("4-4") == [4]
    for bad in ("", "a", "-1", "3-1", "1,,2", "0-5000", "1.5", "0-2-3"):
        with pytest.raises(UserError, match="--seeds"):
            parse_seeds(bad)


def test_threads_per_job() -> None:
    assert threads_per_job(1, cores=8) == 8
    assert threads_per_job(3, cores=8) == 2
    assert threads_per_job(16, cores=8) == 1
    assert threads_per_job(2) >= 1


def _components(path: Path) -> dict[str, str | None]:
    return component_names(yaml.safe_load(load_spec(path).to_yaml()))


def test_component_names_and_differences_of_example_specs() -> None:
    specs = ROOT / "examples" / "specs"
    grpo, rloo, ppo = (_components(specs / f"{n}.yaml") for n in ("grpo", "rloo", "ppo"))
    assert grpo["advantage"] == "grpo"
    assert grpo["critic"] is None and grpo["critic.loss"] is None
    assert grpo["kl"] == "k3" and grpo["kl.estimator"] == "k3"
    assert ppo["critic"] == "clipped_mse" and ppo["critic.target"] == "lambda_return"
    assert ppo["truncation"] == "penalty"

    diff = differing_components({"grpo": grpo, "rloo": rloo})
    assert diff["grpo"] == [
        ("kl.estimator", "k3"),
        ("advantage", "grpo"),
        ("policy.loss", "ppo_clip"),
        ("policy.aggregation", "seq_mean_token_mean"),
    ]
    assert diff["rloo"] == [
        ("kl.estimator", "k1"),
        ("advantage", "rloo"),
        ("policy.loss", "reinforce"),
        ("policy.aggregation", "seq_mean_token_sum"),
    ]
    # a section present in one spec only: critic=none vs critic=<its loss>; its other slots
    # are not listed against "absent"
    diff = differing_components({"grpo": grpo, "ppo": ppo})
    assert ("critic", "none") in diff["grpo"]
    assert ("critic", "clipped_mse") in diff["ppo"]
    assert not any(k.startswith("critic.") for k, _ in diff["grpo"] + diff["ppo"])
    assert ("truncation", "penalty") in diff["ppo"]
    # one spec, or identical components: nothing differs, the label is the name
    assert spec_labels({"grpo": grpo}) == {"grpo": "grpo"}
    assert spec_labels({"x": grpo, "y": dict(grpo)}) == {"x": "x", "y": "y"}


def test_labels_of_minimal_specs() -> None:
    plain = {"advantage": "grpo"}
    critic = {"advantage": {"name": "gae", "lam": 0.9}, "critic": {"loss": "mse"}}
    rewards = {"advantage": "grpo", "reward": [{"name": "demo"}, "demo"]}
    names = {"grpo": component_names(plain), "gae": component_names(critic)}
    assert spec_labels(names) == {
        "grpo": "grpo (advantage=grpo, critic=none)",
        "gae": "gae (advantage=gae, critic=mse)",
    }
    assert component_names(rewards)["reward"] == "demo+demo"
    # within a section both have, the differing slot is named by its path
    a = component_names({"critic": {"loss": "mse", "target": "returns"}})
    b = component_names({"critic": {"loss": "mse"}})
    assert differing_components({"a": a, "b": b}) == {
        "a": [("critic.target", "returns")],
        "b": [("critic.target", "lambda_return")],
    }


def write_run(
    run_dir: Path,
    rewards: Sequence[float],
    *,
    spec: dict[str, Any] | None = None,
    rounds: int | None = None,
    extra: dict[int, dict[str, Any]] | None = None,
    tokens_per_s: float = 100.0,
) -> Path:
    """A run folder as ppokit train leaves it: spec.yaml and metrics.jsonl."""
    run_dir.mkdir(parents=True, exist_ok=True)
    data = dict(spec or {"advantage": "grpo"})
    data["train"] = {**data.get("train", {}), "rounds": rounds or len(rewards)}
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(data))
    lines = []
    for i, r in enumerate(rewards, start=1):
        rec = {"round": i, "reward_mean": r, "time_round": 0.5, "tokens_per_s": tokens_per_s}
        rec.update((extra or {}).get(i, {}))
        lines.append(json.dumps(rec))
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run_dir


def test_run_writes_cover_the_trainers_files() -> None:
    """compare and the trainer read one torch-free list of the files a run writes
    (ppokit/runfolder/): trainer/loop.py imports its RUN_FILES from there (read from the
    source, so no torch is imported), and compare's RUN_WRITES holds every name of it."""
    import ast

    from ppokit import runfolder as runfiles

    tree = ast.parse((ROOT / "ppokit" / "trainer" / "loop.py").read_text())
    imported = {
        alias.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "ppokit.runfolder"
        for alias in n.names
    }
    assert "RUN_FILES" in imported
    assert not any(
        isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "RUN_FILES" for t in n.targets)
        for n in ast.walk(tree)
    )  # no second copy
    names = {*runfiles.RUN_FILES, *runfiles.TEMP_FILES, runfiles.LOCK}
    assert {"metrics.jsonl", "checkpoint", runfiles.MARKER} <= names <= cmp_runs.RUN_WRITES
    assert runfiles.CHECKPOINT == "checkpoint"
    code = "import sys, ppokit.runfolder, ppokit.compare; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_run_status(tmp_path: Path) -> None:
    assert run_status(tmp_path / "absent", 3) == ("new", "")
    (tmp_path / "empty").mkdir()
    assert run_status(tmp_path / "empty", 3)[0] == "new"
    done = write_run(tmp_path / "done", [0.1, 0.2, 0.3])
    assert run_status(done, 3)[0] == "finished"
    assert run_status(done, 2)[0] == "finished"  # more rounds than asked: finished too
    half = write_run(tmp_path / "half", [0.1, 0.2], rounds=3)
    assert run_status(half, 3)[0] == "overwrite"  # no checkpoint: start again
    (half / "checkpoint").mkdir()
    assert run_status(half, 3)[0] == "resume"
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / "error.txt").write_text("error: x\n")
    assert run_status(tmp_path / "failed", 3)[0] == "new"
    foreign = write_run(tmp_path / "foreign", [0.1], rounds=3)
    (foreign / "notes.txt").write_text("mine")
    status, detail = run_status(foreign, 3)
    assert status == "blocked" and "notes.txt" in detail
    (tmp_path / "file").write_text("")
    assert run_status(tmp_path / "file", 3)[0] == "blocked"


def test_plan_and_command(tmp_path: Path) -> None:
    spec_path = write_spec(tmp_path, "a")
    (sweep,) = prepare_specs([spec_path], ["train.rounds=4"])
    out = tmp_path / "sweep"
    runs = out / "runs" / "a"

    def expected(seed: int) -> dict[str, Any]:
        return yaml.safe_load(sweep.spec.model_copy(update={"seed": seed}).to_yaml())

    write_run(runs / "seed-3", [0.1] * 4, spec=expected(3))  # finished
    other = {**expected(4), "advantage": "rloo"}
    write_run(runs / "seed-4", [0.1] * 4, spec=other)  # finished, of another spec
    write_run(runs / "seed-5", [0.1] * 2, spec=expected(5))  # started, no checkpoint
    write_run(runs / "seed-6", [0.1] * 2, spec=expected(6))
    (runs / "seed-6" / "checkpoint").mkdir()  # interrupted

    plans = {s: plan_run(sweep, s, out) for s in (2, 3, 4, 5, 6)}
    assert {s: p.action for s, p in plans.items()} == {
        2: "new",
        3: "skip",
        4: "blocked",
        5: "overwrite",
        6: "resume",
    }
    assert plans[3].status == "finished"
    assert plans[4].status == "failed" and "another spec" in (plans[4].error or "")
    assert "advantage" in (plans[4].error or "")
    assert all(p.rounds == 4 for p in plans.values())

    argv = train_command(plans[6], ["train.rounds=4", "advantage.eps=0.1"])
    assert argv[:5] == python_command(["train", str(spec_path)])
    assert argv[5:9] == ["--seed", "6", "--out", str(runs / "seed-6")]
    assert argv[9:13] == ["--set", "train.rounds=4", "--set", "advantage.eps=0.1"]
    assert argv[-1] == "--resume"
    assert train_command(plans[5], [])[-1] == "--overwrite"
    tail = train_command(plans[2], [])[-2:]
    assert "--overwrite" not in tail and "--resume" not in tail


def test_variant_names_are_specs_of_a_sweep(tmp_path: Path) -> None:
    """``ppokit compare grpo dapo --task arithmetic``: each name a spec (its run folder named
    after it), the task given to each, and each run's command names the variant again."""
    sweeps = prepare_specs([Path("grpo"), Path("dapo")], ["task=arithmetic", "train.rounds=3"])
    assert [s.name for s in sweeps] == ["grpo", "dapo"]
    assert [(s.spec.variant, s.spec.task) for s in sweeps] == [
        ("grpo", "arithmetic"),
        ("dapo", "arithmetic"),
    ]
    assert sweeps[1].spec.rollout.filter.name == "informative"
    plan = plan_run(sweeps[0], 0, tmp_path / "sweep")
    assert train_command(plan, ["task=arithmetic"])[:5] == python_command(["train", "grpo"])
    with pytest.raises(SpecError) as err:
        prepare_specs([Path("grpoo")], [])
    assert "no spec file, variant or task of that name" in str(err.value)


# ---------------------------------------------------------------------- summary
def test_report_statistics_labels_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    g1 = {"advantage": "grpo"}
    g2 = {"advantage": {"name": "gae", "lam": 0.9}, "critic": {"loss": "mse"}}
    base = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    write_run(
        out / "runs" / "g1" / "seed-0",
        base,
        spec={**g1, "seed": 0},
        extra={2: {"eval/accuracy": 0.2}, 4: {"eval/accuracy": 0.4}, 6: {"eval/accuracy": 0.6}},
    )
    write_run(
        out / "runs" / "g1" / "seed-1",
        [r + 0.2 for r in base],
        spec={**g1, "seed": 1},
        extra={1: {"eval/accuracy": 0.9}},
        tokens_per_s=200.0,
    )
    write_run(out / "runs" / "g2" / "seed-0", [0.0] * 7, spec={**g2, "seed": 0})
    failed = write_run(out / "runs" / "g2" / "seed-1", [0.0], spec={**g2, "seed": 1}, rounds=7)
    (failed / "error.txt").write_text("error: it broke\n")

    summary = report(out, threshold=0.5)
    saved = json.loads((out / "summary.json").read_text())
    assert saved == json.loads(json.dumps(cmp_render._json_safe(summary)))
    s1, s2 = saved["specs"]
    assert (s1["name"], s2["name"]) == ("g1", "g2")
    assert s1["label"] == "g1 (advantage=grpo, critic=none)"
    assert s2["label"] == "g2 (advantage=gae, critic=mse)"
    # final reward: mean of the last 5 rounds per run (0.5 and 0.7), then over seeds
    assert s1["final_reward"]["values"] == pytest.approx([0.5, 0.7])
    assert s1["final_reward"]["mean"] == pytest.approx(0.6)
    # t_{0.975,1} * s / sqrt(2) with s = 0.2 / sqrt(2)
    assert s1["final_reward"]["ci95"] == pytest.approx(12.706205 * 0.1, abs=1e-6)
    # eval/accuracy, found generically: rounds 4 and 6 in the window of seed 0 (0.5); seed 1
    # logged it at round 1 only, outside the window: its last value (0.9)
    assert saved["eval_metrics"] == ["eval/accuracy"]
    assert s1["eval"]["eval/accuracy"]["values"] == pytest.approx([0.5, 0.9])
    # rounds to reward >= 0.5: round 5 (seed 0) and round 3 (seed 1)
    assert s1["rounds_to_threshold"] == {"mean": 4.0, "reached": 2, "of": 2, "values": [5, 3]}
    assert s1["wall_time_s"]["mean"] == pytest.approx(3.5)
    assert s1["tokens_per_s"]["mean"] == pytest.approx(150.0)
    assert (s1["finished"], s1["failed"], s1["runs_total"]) == (2, 0, 2)
    # g2: one finished run (no interval), one failed with its error
    assert (s2["finished"], s2["failed"]) == (1, 1)
    assert s2["final_reward"]["mean"] == 0.0 and s2["final_reward"]["ci95"] is None
    assert s2["rounds_to_threshold"]["reached"] == 0
    assert s2["eval"]["eval/accuracy"]["n"] == 0
    assert [r["error"] for r in s2["runs"]] == [None, "error: it broke"]

    md = (out / "summary.md").read_text()
    assert "| g1 | advantage=grpo, critic=none | 2/0/2 | 0.600 ± 1.27 | 0.700 ± 2.54 |" in md
    assert "| g2 | advantage=gae, critic=mse | 1/1/2 | 0.000 (n=1) |" in md
    assert "rounds to reward ≥ 0.5" in md
    assert "error: it broke" in md
    # two panels (reward and eval/accuracy) of 7 x 4.5 inches at 100 dpi
    width, height = png_size(out / "compare.png")
    assert width == 1400 and height > 450  # two panels, the legend below them


def _records(group: str, per_seed: Sequence[Sequence[float]]) -> list[RunRecord]:
    return [
        RunRecord(
            group,
            seed,
            Path(f"runs/{group}/seed-{seed}"),
            "finished",
            len(rewards),
            history=[{"round": i, "reward_mean": r} for i, r in enumerate(rewards, start=1)],
            spec={"seed": seed},
        )
        for seed, rewards in enumerate(per_seed)
    ]


def _band(ax: Any) -> tuple[list[float], list[float]]:
    """The lowest and highest y of the shaded band at each x of ``ax``'s first fill."""
    fill = ax.collections[0]
    low: dict[float, float] = {}
    high: dict[float, float] = {}
    for x, y in fill.get_paths()[0].vertices:
        low[x] = min(low.get(x, y), y)
        high[x] = max(high.get(x, y), y)
    return [low[x] for x in sorted(low)], [high[x] for x in sorted(high)]


def test_plot_band_stays_within_the_seeds_values() -> None:
    """Two seeds: the 95% t-interval is 12.7 times their half-distance (-3..4 for rewards of
    0 and 1); the band drawn is their span, within [0, 1]. The legend says how many seeds a
    curve rests on."""
    seeds = [[0.0, 1.0, 0.2, 0.5], [1.0, 0.0, 0.9, 0.5]]
    one = [[0.3, 0.4, 0.5, 0.6]]
    records = _records("wide", seeds) + _records("single", one)
    summary = summarize(records, 0.9)
    fig = cmp_render.figure(records, summary)
    ax = fig.axes[0]
    low, high = _band(ax)
    assert low == pytest.approx([min(a, b) for a, b in zip(*seeds, strict=True)])
    assert high == pytest.approx([max(a, b) for a, b in zip(*seeds, strict=True)])
    assert all(0.0 <= y <= 1.0 for y in low + high)
    # the unclipped interval went far outside [0, 1]
    assert mean_ci95([0.0, 1.0])[1] > 6
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [
        f"{summary['specs'][0]['label']} (2 seeds)",
        f"{summary['specs'][1]['label']} (1 seed)",
    ]


def test_each_arms_health_signs_are_in_the_summary() -> None:
    """A sign that fired in a run shows in its arm's row (in how many runs) and in the run's."""
    records = _records("grpo", [[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]]) + _records("dapo", [[0.5]])
    records[0].history[1]["health/constant_reward"] = 1.0
    records[0].history[2]["health/entropy"] = 1.0
    records[1].history[2]["health/entropy"] = 1.0
    summary = summarize(records, 0.9)
    grpo, dapo = summary["specs"]
    assert grpo["signs"] == {"constant_reward": 1, "entropy": 2} and dapo["signs"] == {}
    assert [r["signs"] for r in grpo["runs"]] == [["constant_reward", "entropy"], ["entropy"]]
    text = cmp_render.render_markdown(summary)
    assert "constant_reward (1/2), entropy (2/2)" in text
    assert "| constant_reward, entropy |" in text


def test_overlapping_arms_differ_in_line_style_as_well_as_colour() -> None:
    """Two arms with the same curve (GRPO and DAPO on the demo can be that close) are still
    told apart: each has a line style of its own."""
    same = [[0.1, 0.5, 0.9]]
    records = [*_records("grpo", same), *_records("dapo", same), *_records("rloo", same)]
    fig = cmp_render.figure(records, summarize(records, 0.9))
    lines = fig.axes[0].get_lines()
    assert len(lines) == 3
    assert len({line.get_linestyle() for line in lines}) == 3
    assert len({str(line.get_color()) for line in lines}) == 3


def test_plot_legend_counts_seeds_per_round() -> None:
    """A run shorter than the others: the curve rests on 2 seeds at some rounds, 3 at others."""
    records = _records("g", [[0.1, 0.2, 0.3], [0.2, 0.3, 0.4], [0.3]])
    fig = cmp_render.figure(records, summarize(records, 0.9))
    assert fig.legends[0].get_texts()[0].get_text().endswith("(2-3 seeds)")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(-5, 5, allow_nan=False), min_size=3, max_size=3),
        min_size=1,
        max_size=12,
    )
)
def test_curve_band_is_the_interval_within_the_range(per_seed: list[list[float]]) -> None:
    """At each round the band is [mean - h, mean + h] ∩ [min, max] of the seeds' values."""
    xs, means, lows, highs, counts = cmp_render._curve(_records("g", per_seed), "reward_mean")
    assert xs == [1, 2, 3] and counts == [len(per_seed)] * 3
    for i, (mean, low, high) in enumerate(zip(means, lows, highs, strict=True)):
        values = [run[i] for run in per_seed]
        m, h = mean_ci95(values)
        h = h if math.isfinite(h) else 0.0
        assert mean == pytest.approx(m)
        assert low == pytest.approx(max(m - h, min(values)))
        assert high == pytest.approx(min(m + h, max(values)))
        # within what the seeds reached; low <= high up to the mean's rounding
        assert min(values) <= low <= high + 1e-12 and high <= max(values)


def test_report_add_and_errors(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    write_run(out / "runs" / "grpo" / "seed-0", [0.5] * 3, spec={"seed": 0})
    elsewhere = tmp_path / "elsewhere"
    write_run(elsewhere / "mine" / "seed-4", [0.2] * 3, spec={"seed": 4})
    write_run(elsewhere / "plain", [0.3] * 3, spec={"seed": 9})
    write_run(elsewhere / "x", [0.4] * 3, spec={"seed": 1})
    result = invoke(
        "--report",
        str(out),
        "--add",
        str(elsewhere / "mine" / "seed-4"),
        "--add",
        str(elsewhere / "plain"),
        "--add",
        f"other={elsewhere / 'x'}",
    )
    assert result.exit_code == 0, result.output + result.stderr
    saved = json.loads((out / "summary.json").read_text())
    groups = {g["name"]: [r["seed"] for r in g["runs"]] for g in saved["specs"]}
    assert groups == {"grpo": [0], "mine": [4], "plain": [9], "other": [1]}
    assert (out / "compare.png").is_file()
    # written elsewhere with --out
    result = invoke("--report", str(out), "--out", str(tmp_path / "copy"))
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "copy" / "summary.md").is_file()

    assert_user_error(invoke("--report", str(tmp_path / "nope")), "not a directory")
    (tmp_path / "bare").mkdir()
    assert_user_error(invoke("--report", str(tmp_path / "bare")), "no runs found")
    assert_user_error(
        invoke("--report", str(out), "--add", str(tmp_path / "bare")), "not a ppokit run"
    )
    assert_user_error(invoke("--report", str(out), str(tmp_path / "a.yaml")), "give no SPEC")


def test_user_errors(tmp_path: Path) -> None:
    good = write_spec(tmp_path, "good")
    bad = write_spec(tmp_path, "bad", advantage="no_such_estimator")
    out = tmp_path / "sweep"
    assert_user_error(invoke(str(good), "--seeds", "3-1", "--out", str(out)), "--seeds")
    assert_user_error(invoke(str(good), "--seeds", "x", "--out", str(out)), "--seeds")
    result = invoke(str(good), str(bad), "--out", str(out))
    assert_user_error(result, str(bad), "advantage")
    assert not out.exists()  # nothing launched, nothing written
    result = invoke(str(good), "--set", "rollout.n=0", "--out", str(out))
    assert_user_error(result, "rollout.n")
    assert_user_error(invoke(str(tmp_path / "missing.yaml"), "--out", str(out)), "not found")
    assert_user_error(invoke(str(good)), "--out DIR is required")
    assert_user_error(invoke("--out", str(out)), "at least one SPEC")
    assert_user_error(invoke(str(good), "--out", str(out), "--add", "x"), "--add")
    (tmp_path / "file").write_text("")
    result = invoke(str(good), "--seeds", "0", "--out", str(tmp_path / "file" / "sub"))
    assert_user_error(result, "cannot create the folder (not a directory)")
    other = tmp_path / "other"
    other.mkdir()
    write_spec(other, "good")
    result = invoke(str(good), str(other / "good.yaml"), "--out", str(out))
    assert_user_error(result, "same name")


# ---------------------------------------------------------------------- a stand-in trainer
FAKE_TRAIN = """
import json, os, sys, time
from pathlib import Path
out, seed, rounds, action = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
mode = sys.argv[5]
out.mkdir(parents=True, exist_ok=True)
(out.parent / f"seed-{seed}.env").write_text(
    json.dumps({k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    | {"action": action, "pid": os.getpid()}))
if mode == "sleep":
    time.sleep(60)
if mode == "fail" and seed == 1:
    print("working", flush=True)
    sys.stderr.write("Traceback (most recent call last):\\n  ...\\nRuntimeError: boom seed 1\\n")
    sys.exit(1)
(out / "spec.yaml").write_text(Path(sys.argv[6]).read_text())
with open(out / "metrics.jsonl", "w") as fh:
    for r in range(1, rounds + 1):
        fh.write(json.dumps({"round": r, "reward_mean": 0.1 * seed + 0.01 * r,
                             "time_round": 0.01, "tokens_per_s": 10.0}) + "\\n")
"""


def fake_command(script: Path, mode: str) -> Any:
    def command(run: SweepRun, overrides: Sequence[str]) -> list[str]:
        # the resolved spec the run writes, as ppokit train would
        spec = load_spec(run.spec_path, [*overrides, f"seed={run.seed}"])
        spec_file = script.parent / f"{run.name}-{run.seed}.spec.yaml"
        spec_file.write_text(spec.to_yaml())
        args = [str(run.dir), str(run.seed), str(run.rounds), run.action, mode, str(spec_file)]
        return [sys.executable, str(script), *args]

    return command


@pytest.fixture
def fake_script(tmp_path: Path) -> Path:
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    return path


def test_failed_run_is_reported_and_the_sweep_goes_on(tmp_path: Path, fake_script: Path) -> None:
    spec = write_spec(tmp_path, "a")
    out = tmp_path / "sweep"
    blocked = out / "runs" / "a" / "seed-3"
    blocked.mkdir(parents=True)
    (blocked / "notes.txt").write_text("not ppokit's")
    stream = io.StringIO()
    summary, runs, completed = run_sweep(
        [spec],
        [0, 1, 2, 3],
        out,
        jobs=2,
        live=False,
        command=fake_command(fake_script, "fail"),
        stream=stream,
    )
    assert completed
    status = {r.seed: r.status for r in runs}
    assert status == {0: "finished", 1: "failed", 2: "finished", 3: "failed"}
    by_seed = {r.seed: r for r in runs}
    assert by_seed[1].error == "RuntimeError: boom seed 1"
    assert (out / "runs" / "a" / "seed-1" / "error.txt").read_text() == (
        "RuntimeError: boom seed 1\n"
    )
    assert "working" in (out / "logs" / "a" / "seed-1.out").read_text()
    # the blocked folder is reported, not launched and not written to
    assert "notes.txt" in (by_seed[3].error or "")
    assert sorted(p.name for p in blocked.iterdir()) == ["notes.txt"]
    assert not (out / "runs" / "a" / "seed-3.env").exists()
    # each of 2 jobs gets cores // 2 threads
    env = json.loads((out / "runs" / "a" / "seed-0.env").read_text())
    want = str(threads_per_job(2))
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == want
    # one plain line per event
    lines = stream.getvalue().splitlines()
    assert sum(line.startswith("started: a seed") for line in lines) == 3
    assert any(line.startswith("failed: a seed 1") for line in lines)
    assert any(line.startswith("blocked: a seed 3") for line in lines)
    (group,) = summary["specs"]
    assert (group["finished"], group["failed"]) == (2, 2)
    assert group["final_reward"]["values"] == pytest.approx([0.0 + 0.02, 0.2 + 0.02])
    md = (out / "summary.md").read_text()
    assert "RuntimeError: boom seed 1" in md

    # again: the finished runs stay as they are, the failed one is tried again (and its
    # stale error.txt goes), the blocked one stays blocked
    before = {s: snapshot(out / "runs" / "a" / f"seed-{s}") for s in (0, 2)}
    _, runs, _ = run_sweep(
        [spec],
        [0, 1, 2, 3],
        out,
        live=False,
        command=fake_command(fake_script, "ok"),
        stream=io.StringIO(),
    )
    assert {r.seed: r.action for r in runs} == {0: "skip", 1: "new", 2: "skip", 3: "blocked"}
    assert {r.seed: r.status for r in runs} == {
        0: "finished",
        1: "finished",
        2: "finished",
        3: "failed",
    }
    assert not (out / "runs" / "a" / "seed-1" / "error.txt").exists()
    assert {s: snapshot(out / "runs" / "a" / f"seed-{s}") for s in (0, 2)} == before


def test_interrupt_stops_every_run(tmp_path: Path, fake_script: Path) -> None:
    spec = write_spec(tmp_path, "a")
    out = tmp_path / "sweep"
    # a SIGTERM arriving after the sweep must not end the test process
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        env_files = [out / "runs" / "a" / f"seed-{s}.env" for s in (0, 1)]

        def stop_when_started() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(p.exists() for p in env_files):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)

        timer = threading.Thread(target=stop_when_started, daemon=True)
        timer.start()
        t0 = time.monotonic()
        summary, runs, completed = run_sweep(
            [spec],
            [0, 1, 2],
            out,
            jobs=2,
            live=False,
            command=fake_command(fake_script, "sleep"),
            stream=io.StringIO(),
            grace=5.0,
        )
        timer.join(5)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not completed
    assert time.monotonic() - t0 < 30
    assert [r.status for r in runs] == ["interrupted"] * 3
    for path in env_files:
        pid = json.loads(path.read_text())["pid"]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert summary["specs"][0]["other"] == 3
    assert (out / "summary.md").is_file()


def test_live_view_and_time_left(tmp_path: Path) -> None:
    from rich.console import Console

    def run(seed: int, status: str, **kw: Any) -> SweepRun:
        r = SweepRun("a", seed, tmp_path / f"seed-{seed}", tmp_path / "a.yaml", 3, "new", **kw)
        r.status = status
        return r

    now = time.perf_counter()
    runs = [
        run(0, "finished", wall=10.0),
        run(1, "finished", wall=20.0),
        run(2, "failed", error="error: it broke"),
        run(3, "running", started=now - 5.0),
        run(4, "pending"),
        run(5, "pending"),
    ]
    write_run(runs[3].dir, [0.1, 0.2], rounds=3)
    progress = cmp_progress.Progress(runs, jobs=2)
    # mean wall 15 s: 2 pending runs (30 s) and ~10 s left of the running one, over 2 jobs
    assert progress.eta(now) == pytest.approx(20.0, abs=0.1)
    assert progress.line().startswith(
        "3/6 done: 2 finished, 1 failed, 1 running, 2 pending; about 2"
    )
    buffer = io.StringIO()
    view = cmp_progress.LiveView(progress, Console(file=buffer, force_terminal=True, width=120))
    view.start()
    view.event(runs[2], "failed")
    view.refresh()
    view.stop()
    text = cmp_runs.ANSI.sub("", buffer.getvalue())
    assert "ppokit compare" in text and "round 2/3" in text
    assert "failed: a seed 2: error: it broke" in text
    assert cmp_progress.Progress([run(0, "pending")], jobs=1).eta() is None


# ---------------------------------------------------------------------- real tiny runs
@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 specs x 2 seeds of the tiny model, 2 rounds each, 2 jobs, through the command."""
    root = tmp_path_factory.mktemp("compare")
    specs = {
        # grpo: 3 rounds in the file; the first sweep runs 2 (--set), the last resumes to 3
        "grpo": write_spec(root, "grpo", advantage="grpo", train={"rounds": 3}),
        "gae": write_spec(
            root,
            "gae",
            advantage={"name": "gae", "gamma": 1.0, "lam": 0.95},
            critic={"loss": "mse"},
            train={"rounds": 2},
        ),
        "bad": write_spec(root, "bad", model={"actor": str(root / "no-such-model")}),
    }
    out = root / "sweep"
    t0 = time.monotonic()
    result = invoke(
        str(specs["grpo"]),
        str(specs["gae"]),
        "--seeds",
        "0-1",
        "--set",
        "train.rounds=2",
        "--out",
        str(out),
        "--jobs",
        "2",
    )
    return {
        "root": root,
        "out": out,
        "specs": specs,
        "result": result,
        "seconds": time.monotonic() - t0,
    }


@pytest.mark.slow
def test_real_sweep_summary_and_plot(real_sweep: dict[str, Any]) -> None:
    result, out = real_sweep["result"], real_sweep["out"]
    assert result.exit_code == 0, result.output + result.stderr
    assert result.output.count("started: ") == 4
    for name in ("grpo", "gae"):
        for seed in (0, 1):
            run = out / "runs" / name / f"seed-{seed}"
            rounds = [json.loads(line)["round"] for line in (run / "metrics.jsonl").open()]
            assert rounds == [1, 2]
            assert yaml.safe_load((run / "spec.yaml").read_text())["seed"] == seed
            assert (out / "logs" / name / f"seed-{seed}.err").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert [g["name"] for g in summary["specs"]] == ["grpo", "gae"]
    labels = [g["label"] for g in summary["specs"]]
    assert labels == ["grpo (advantage=grpo, critic=none)", "gae (advantage=gae, critic=mse)"]
    for g in summary["specs"]:
        assert (g["finished"], g["failed"], g["runs_total"]) == (2, 0, 2)
        assert g["final_reward"]["n"] == 2
        assert 0.0 <= g["final_reward"]["mean"] <= 1.0
        assert g["final_reward"]["ci95"] is not None and g["final_reward"]["ci95"] >= 0
        assert g["wall_time_s"]["mean"] > 0 and g["tokens_per_s"]["mean"] > 0
        assert g["rounds_to_threshold"]["of"] == 2
        assert [r["rounds"] for r in g["runs"]] == [2, 2]
    md = (out / "summary.md").read_text()
    assert "| grpo | advantage=grpo, critic=none | 2/0/2 |" in md
    assert "| gae | advantage=gae, critic=mse | 2/0/2 |" in md
    width, height = png_size(out / "compare.png")
    assert width == 700 and height > 450  # one panel (no eval metric), the legend below


@pytest.mark.slow
def test_real_report_rerenders(real_sweep: dict[str, Any]) -> None:
    out = real_sweep["out"]
    before = json.loads((out / "summary.json").read_text())
    (out / "summary.md").unlink()
    (out / "compare.png").unlink()
    result = invoke("--report", str(out))
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads((out / "summary.json").read_text()) == before
    assert (out / "summary.md").is_file() and (out / "compare.png").is_file()


@pytest.mark.slow
def test_real_restart_skips_finished_and_resumes_interrupted(real_sweep: dict[str, Any]) -> None:
    """Runs after the tests above (it extends the sweep's runs)."""
    out, specs = real_sweep["out"], real_sweep["specs"]
    runs = out / "runs"
    before = snapshot(runs)
    # the same command again: every run is finished, nothing is launched or rewritten
    result = invoke(
        str(specs["grpo"]),
        str(specs["gae"]),
        "--seeds",
        "0-1",
        "--set",
        "train.rounds=2",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output + result.stderr
    assert "started" not in result.output and "resumed" not in result.output
    assert result.output.count("finished already: ") == 4
    assert snapshot(runs) == before

    # without the override grpo wants 3 rounds: its seed-1 run was interrupted at round 2 and
    # resumes from its checkpoint; gae (2 rounds) is finished; 'bad' fails at run time
    grpo_lines = (runs / "grpo" / "seed-1" / "metrics.jsonl").read_text().splitlines()
    gae_before = snapshot(runs / "gae" / "seed-1")
    t0 = time.monotonic()
    result = invoke(
        str(specs["grpo"]),
        str(specs["gae"]),
        str(specs["bad"]),
        "--seeds",
        "1",
        "--out",
        str(out),
        "--jobs",
        "2",
    )
    seconds = time.monotonic() - t0
    assert result.exit_code == 1, result.output + result.stderr
    assert "resumed: grpo seed 1" in result.output
    assert "finished already: gae seed 1" in result.output
    assert "failed: bad seed 1" in result.output
    lines = (runs / "grpo" / "seed-1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2, 3]
    assert lines[:2] == grpo_lines  # resumed, not started again
    assert snapshot(runs / "gae" / "seed-1") == gae_before
    error = (runs / "bad" / "seed-1" / "error.txt").read_text()
    assert "model.actor" in error and error.count("\n") == 1
    assert "bad seed 1: " in result.stderr and "1 of 3 run(s) failed" in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    by_name = {g["name"]: g for g in summary["specs"]}
    assert (by_name["bad"]["finished"], by_name["bad"]["failed"]) == (0, 1)
    assert by_name["grpo"]["runs"][0]["rounds"] == 3
    assert math.isfinite(by_name["grpo"]["final_reward"]["mean"])
    # the untouched seed-0 runs were never part of this sweep
    assert snapshot(runs / "grpo" / "seed-0") == {
        k[len("grpo/seed-0/") :]: v for k, v in before.items() if k.startswith("grpo/seed-0/")
    }
    print(f"first sweep {real_sweep['seconds']:.1f} s, restart sweep {seconds:.1f} s")


def test_record_defaults() -> None:
    rec = RunRecord("g", 0, Path("x"), "finished", 3)
    assert rec.history == [] and rec.spec is None and rec.error is None
