"""The console tells the truth: one short plain line per round without a terminal, a live
display whose round counter and clock are never cut, a summary whose "best" knows each
metric's direction and shows missing values as missing, Ctrl-C names the last checkpoint and
the command that resumes (exit status 130), curves.png has a title and labelled axes, and a
small CPU run uses one thread."""

from __future__ import annotations

import io
import math
import shlex
from pathlib import Path

import pytest
import torch
from PIL import Image
from rich.console import Console
from typer.testing import CliRunner

import ppokit
import ppokit.trainer.loop as loop_module
from ppokit.cli import app
from ppokit.trainer import train
from ppokit.trainer.display import (
    MISSING,
    PLAIN_WIDTH,
    Display,
    best_direction,
    plain_line,
    summary_row,
    summary_table,
)
from ppokit.trainer.lifecycle import ending
from ppokit.trainer.metrics import Meter, plot_curves, read_metrics, read_once
from ppokit.trainer.models import build_models
from ppokit.trainer.threads import choose_threads
from tests.helpers.trainer import DEMO, SMALL, small_spec

FULL = {
    "round": 3,
    "reward_mean": 0.41234,
    "response_length_mean": 7.5,
    "kl": 0.0123,
    "entropy": 1.234,
    "value_loss": 0.0456,
    "clipfrac": 0.02,
    "tokens_per_s": 812.4,
}


# ---------------------------------------------------------------------- plain lines
def test_the_plain_line_has_the_round_the_key_metrics_the_time_and_the_eta() -> None:
    line = plain_line(FULL, 200, 2.13, 425.0)
    assert line.startswith("round 3/200  reward 0.412  len 7.5  kl 0.0123")
    assert "ent 1.23" in line and "vloss 0.0456" in line and "812 tok/s" in line
    assert "clip" not in line  # the least important metric makes room
    assert line.endswith("2.1s  eta 7m05s")
    assert len(line) <= PLAIN_WIDTH and "\n" not in line


def test_the_plain_line_never_exceeds_its_width_and_keeps_round_and_times() -> None:
    huge = {k: (-1.234567e-300 if k != "round" else 1_000_000_000) for k in FULL}
    line = plain_line(huge, 1_073_741_824, 123456.0, 9.9e9)
    assert len(line) <= PLAIN_WIDTH
    assert line.startswith("round 1000000000/1073741824") and " eta " in line
    assert line.endswith("eta 2750000h00m")


def test_the_plain_line_shows_missing_values_as_missing() -> None:
    record = {"round": 1, "reward_mean": None, "kl": math.nan, "entropy": None, "value_loss": 0.5}
    line = plain_line(record, 10, None, None)
    assert line == f"round 1/10  reward {MISSING}  vloss 0.5  ?  eta ?"


def test_without_a_terminal_each_round_is_one_plain_line() -> None:
    stream = io.StringIO()  # not a TTY: plain lines even when the live display is asked for
    display = Display(3, 0, live=True, stream=stream)
    display.message("ppokit: 3 round(s)")
    for r in (1, 2, 3):
        display.start_round(r)
        display.phase("generating")
        display.round({**FULL, "round": r}, 3)
    display.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "ppokit: 3 round(s)"
    assert [line.split("  ")[0] for line in lines[1:]] == ["round 1/3", "round 2/3", "round 3/3"]
    assert all(len(line) <= PLAIN_WIDTH for line in lines)
    assert lines[-1].endswith("eta 0s")


@pytest.mark.parametrize("width", [30, 50, 120])
def test_the_live_display_never_cuts_the_round_counter_or_the_clock(width: int) -> None:
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=width, color_system=None)
    display = Display(200, 0, live=True, console=console)
    assert display.progress is not None
    display.start_round(1)
    display.round(FULL | {"round": 1}, 200)
    display.start_round(2)
    display.phase("generating")
    display.progress.refresh()
    frame = stream.getvalue().split("\r")[-1]
    display.close()
    assert "1/200" in frame and " eta " in frame
    if width >= 120:
        assert "generating" in frame and "reward 0.412" in frame and "812 tok/s" in frame


# ---------------------------------------------------------------------- summary
HISTORY = [
    {
        "round": 1,
        "reward_mean": 0.1,
        "value_loss": 0.5,
        "entropy": 2.0,
        "kl": 0.01,
        "explained_variance": None,  # targets without variance: NaN, recorded as None
        "clipfrac": None,  # nothing to average: no row had weight
        "grad_norm_actor": 3.0,
        "eval/accuracy": 0.2,
    },
    {
        "round": 2,
        "reward_mean": 0.7,
        "value_loss": 0.1,
        "entropy": 1.0,
        "kl": 0.05,
        "explained_variance": 0.3,
        "clipfrac": 0.1,
        "grad_norm_actor": 1.0,
    },
    {
        "round": 3,
        "reward_mean": 0.5,
        "value_loss": 0.3,
        "entropy": 1.5,
        "kl": 0.03,
        "explained_variance": 0.6,
        "clipfrac": None,
        "grad_norm_actor": 2.0,
        "eval/accuracy": 0.4,
    },
]


def test_best_directions() -> None:
    for key in ("reward_mean", "explained_variance", "eval/accuracy", "eval/pass@4", "reward/x"):
        assert best_direction(key) == "max", key
    for key in ("value_loss", "value_error"):
        assert best_direction(key) == "min", key
    for key in (
        "policy_loss",  # a surrogate's value: no better direction
        "eval/accuracy_ci95",
        "eval/prompts",
        "rollout/correction_masked_frac",
        "policy/some_new_metric",
        "entropy",
        "kl",
        "kl_coef",
        "approx_kl",
        "grad_norm_actor",
        "grad_norm_critic",
        "clipfrac",
        "vf_clipfrac",
        "response_length_mean",
        "eval/response_length_mean",
        "time_round",
        "tokens_per_s",
    ):
        assert best_direction(key) is None, key


def test_summary_rows_follow_each_metrics_direction() -> None:
    assert summary_row(HISTORY, "reward_mean") == ("0.1", "0.5", "0.7")
    assert summary_row(HISTORY, "value_loss") == ("0.5", "0.3", "0.1")
    assert summary_row(HISTORY, "entropy") == ("2", "1.5", MISSING)
    assert summary_row(HISTORY, "kl") == ("0.01", "0.03", MISSING)
    assert summary_row(HISTORY, "grad_norm_actor") == ("3", "2", MISSING)
    assert summary_row(HISTORY, "explained_variance") == (MISSING, "0.6", "0.6")
    assert summary_row(HISTORY, "clipfrac") == (MISSING, MISSING, MISSING)
    assert summary_row(HISTORY, "eval/accuracy") == ("0.2", "0.4", "0.4")
    assert summary_row(HISTORY, "value_error") == (MISSING, MISSING, MISSING)  # absent


def test_the_summary_table_shows_missing_as_missing_never_zero() -> None:
    stream = io.StringIO()
    Console(file=stream, width=100, color_system=None).print(summary_table(HISTORY, "runs/x"))
    rows = {
        cells[0]: cells[1:]
        for line in stream.getvalue().splitlines()
        if "│" in line
        for cells in [[c.strip() for c in line.strip("│ ").split("│")]]
    }
    assert list(rows)[:2] == ["reward_mean", "eval/accuracy"]
    assert "value_error" not in rows  # no value in any round
    assert rows["clipfrac"] == [MISSING, MISSING, MISSING]
    assert rows["explained_variance"] == [MISSING, "0.6", "0.6"]
    assert rows["reward_mean"] == ["0.1", "0.5", "0.7"]


def test_a_metric_with_nothing_counted_is_missing_not_zero() -> None:
    meter = Meter()
    meter.add("clipfrac", torch.tensor(0.0), torch.tensor(0.0))
    meter.add("entropy", torch.tensor(3.0), torch.tensor(2.0))
    assert read_once(meter.means()) == {"clipfrac": None, "entropy": 1.5}


# ---------------------------------------------------------------------- Ctrl-C
def _cli_args(out: Path, *extra: str) -> list[str]:
    sets = [a for item in SMALL for a in ("--set", item)]
    return ["train", str(DEMO), *sets, "--set", "train.rounds=3", "--out", str(out), *extra]


def _interrupt_at(monkeypatch: pytest.MonkeyPatch, round_no: int) -> None:
    real = loop_module.run_round

    def run_round(setup, state, produced, **kw):  # type: ignore[no-untyped-def]
        if kw["round_no"] == round_no:
            raise KeyboardInterrupt
        return real(setup, state, produced, **kw)

    monkeypatch.setattr(loop_module, "run_round", run_round)


def test_ctrl_c_names_the_last_checkpoint_and_the_command_that_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "my run"
    runner = CliRunner()
    _interrupt_at(monkeypatch, 3)
    args = _cli_args(out, "--set", "output.save_every=1", "--seed", "3", "--threads", "1")
    result = runner.invoke(app, args)
    assert result.exit_code == 130, result.output
    assert "Traceback" not in result.output + result.stderr
    lines = result.stderr.strip().splitlines()
    assert "interrupted during round 3/3; the last checkpoint is round 2" in lines[-2]
    assert str(out / "checkpoint") in lines[-2]
    command = lines[-1].removeprefix("continue with: ")
    assert command.startswith("ppokit train ") and command.endswith(
        f"--seed 3 --threads 1 --out {shlex.quote(str(out))} --resume"
    )
    monkeypatch.undo()
    argv = shlex.split(command)
    assert argv[:2] == ["ppokit", "train"]
    resumed = runner.invoke(app, argv[1:])  # the exact command: same spec, resumes
    assert resumed.exit_code == 0, resumed.stderr
    assert "resumed at round 2" in resumed.stderr
    assert [h["round"] for h in read_metrics(out)] == [1, 2, 3]


def test_ctrl_c_before_the_first_checkpoint_says_to_start_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, 1)  # no round finished: nothing to save
    result = CliRunner().invoke(app, _cli_args(out))
    assert result.exit_code == 130
    lines = result.stderr.strip().splitlines()
    assert lines[-2] == (
        f"interrupted during round 1/3; no checkpoint was written yet in {out} (output.save_every=10)"
    )
    assert lines[-1].startswith("start again with: ppokit train ")
    assert lines[-1].endswith(f"--out {out} --overwrite")


# ---------------------------------------------------------------------- curves.png
def test_curves_have_a_title_and_labelled_axes(tmp_path: Path) -> None:
    path = tmp_path / "curves.png"
    fig = plot_curves(HISTORY, path, title="runs/x · seed 3 · 2025-01-01 10:00")
    assert fig._suptitle.get_text() == "runs/x · seed 3 · 2025-01-01 10:00"
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert {ax.get_title() for ax in panels} >= {"reward_mean", "value_loss", "kl"}
    assert all(ax.get_xlabel() == "round" and ax.get_ylabel() for ax in panels)
    assert Image.open(path).text["Title"] == "runs/x · seed 3 · 2025-01-01 10:00"


# ---------------------------------------------------------------------- threads
def test_thread_choice() -> None:
    assert choose_threads(None, "cpu", 135_000_000) == (None, "torch's default")
    assert choose_threads(None, "cuda", 1_000) == (None, "torch's default")
    threads, why = choose_threads(None, "cpu", 30_000)
    assert threads == 1 and "automatic" in why
    assert choose_threads(4, "cpu", 30_000) == (4, "model.threads")
    assert choose_threads(2, "cuda", 10**9) == (2, "model.threads")


def test_the_api_applies_the_thread_rule() -> None:
    """``ppokit.set_threads``: the rule of ``ppokit train`` for a loop of one's own."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        spec = small_spec(None, "model.device=cpu")
        models = build_models(spec, 1)
        assert ppokit.set_threads(spec, models) == (
            "1 CPU thread (automatic: a 0.027M-parameter model on the CPU)"
        )
        assert torch.get_num_threads() == 1
        own = small_spec(None, "model.device=cpu", "model.threads=3")
        assert ppokit.set_threads(own, models) == "3 CPU threads (model.threads)"
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_small_cpu_run_uses_one_thread_and_restores_torchs(tmp_path: Path, capsys) -> None:
    before = torch.get_num_threads()
    result = train(small_spec(tmp_path / "a", "model.device=cpu"))
    assert result["threads"] == 1
    assert torch.get_num_threads() == before
    err = capsys.readouterr().err
    assert "1 CPU thread (automatic: a 0.027M-parameter model on the CPU)" in err
    result = train(small_spec(tmp_path / "b", "model.device=cpu", "model.threads=2"))
    assert result["threads"] == 2
    assert "2 CPU threads (model.threads)" in capsys.readouterr().err
    assert (tmp_path / "b" / "curves.png").is_file()
    assert str(tmp_path / "b") in Image.open(tmp_path / "b" / "curves.png").text["Title"]


# ---------------------------------------------------------------------- the end of a run
def test_a_finished_run_says_where_its_results_are_and_how_to_look(tmp_path: Path) -> None:
    out = tmp_path / "my run"
    args = _cli_args(out, "--threads", "1", "--set", "output.sample_every=1", "--json")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    json_out = result.stdout  # --json: stdout stays one JSON document
    assert json_out.lstrip().startswith("{") and "results in" not in json_out
    lines = result.stderr.strip().splitlines()
    assert lines[-4:] == [
        f"results in {out}:",
        "  curves.png (the curves), metrics.jsonl (every round's metrics), "
        "samples.jsonl (sampled responses), checkpoint/ (for --resume, eval and export)",
        f"the curves: {shlex.quote(str(out / 'curves.png'))}",
        f"held-out accuracy: ppokit eval {shlex.quote(str(out))}",
    ]
    for name in ("curves.png", "metrics.jsonl", "samples.jsonl", "checkpoint"):
        assert (out / name).exists()


def test_the_results_lines_name_only_what_exists(tmp_path: Path) -> None:
    assert ending.where_results(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "tensorboard").mkdir()
    first, files, accuracy, board = ending.where_results(tmp_path)
    assert (first, files) == (f"results in {tmp_path}:", "  metrics.jsonl (every round's metrics)")
    assert accuracy == f"held-out accuracy: ppokit eval {tmp_path}"
    assert board == f"every metric: tensorboard --logdir {tmp_path / 'tensorboard'}"


def test_the_results_lines_fit_160_columns_with_a_60_character_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = Path("runs") / ("r" * 55)  # --out of 60 characters
    assert len(str(out)) == 60
    out.mkdir(parents=True)
    for name in ("curves.png", "metrics.jsonl", "samples.jsonl", "checkpoint", "tensorboard"):
        (out / name).mkdir()
    lines = ending.where_results(out)
    assert len(lines) == 5 and max(len(line) for line in lines) <= 160
