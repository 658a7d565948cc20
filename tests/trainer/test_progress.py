"""A run says what it is doing from its first second: the display opens before the models
load and names each step; the engine reports its decoding steps (step of most, responses,
tokens/s, time left); without a terminal a status line comes every few seconds while a step
lasts and nothing is wider than the console's 160 columns; third-party progress bars and
math-verify's timeout notice stay out; a smoke run says what its zeros mean;
``ppokit train --print-spec`` shows the spec that would run."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from ppokit.cli import app
from ppokit.spec import load_spec, validate_spec
from ppokit.trainer import train
from ppokit.trainer.display import CONSOLE_WIDTH, Display, console_width, summary_table
from ppokit.trainer.models import _gguf_progress
from tests.helpers.trainer import DEMO, learner, small_spec


def plain(every: float = 0.2) -> tuple[Display, io.StringIO]:
    stream = io.StringIO()
    return Display(30, 0, live=True, stream=stream, every=every), stream


def test_a_step_before_the_rounds_is_a_line_at_once() -> None:
    display, stream = plain(every=0)
    display.step("loading the actor smollm2-135m-instruct")
    assert stream.getvalue() == "ppokit: loading the actor smollm2-135m-instruct\n"
    display.close()


def test_a_step_that_lasts_gets_status_lines_with_the_generation() -> None:
    display, stream = plain(every=0.3)
    display.step("evaluating 200 held-out prompts", passes=8)
    for step in range(1, 4):
        display.generation(step, 48, 50)
        time.sleep(0.05)
    time.sleep(1.5)
    display.start_round(1)
    display.phase("generating")
    display.generation(0, 48, 32)
    time.sleep(0.7)
    display.generation(1, 48, 32)
    display.generation(2, 48, 32)
    time.sleep(1.5)
    display.round({"round": 1, "reward_mean": 0.5}, 30)
    display.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "ppokit: evaluating 200 held-out prompts"
    status = [line for line in lines if "pass 1/8, step 3/48 x 50 responses" in line]
    assert status and " tok/s, at most " in status[0] and status[0].endswith(" left")
    rounds = [line for line in lines if line.startswith("round 1/30  generating")]
    assert "step 0/48 x 32 responses: the prompts' forward pass" in rounds[0]
    assert "step 2/48 x 32 responses" in rounds[-1]
    assert lines[-1].startswith("round 1/30  reward 0.5")
    assert all(len(line) <= CONSOLE_WIDTH for line in lines)


def test_the_rate_leaves_out_the_prompts_forward_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import ppokit.trainer.display as display_module

    clock = [100.0]
    monkeypatch.setattr(display_module.time, "perf_counter", lambda: clock[0])
    display, _ = plain(every=0)
    display.generation(0, 48, 10)
    clock[0] += 30.0  # a slow forward pass over the prompts
    display.generation(1, 48, 10)
    assert display.gen is not None and display.gen.text(clock[0]) == "step 1/48 x 10 responses"
    clock[0] += 1.0
    display.generation(2, 48, 10)
    # 10 tokens in 1 s, 46 steps of 1 s left (not 20 tokens in 31 s)
    assert display.gen.text(clock[0]) == "step 2/48 x 10 responses, 10 tok/s, at most 46s left"
    display.close()


def test_no_status_line_while_lines_come_often() -> None:
    display, stream = plain(every=0.5)
    for r in range(1, 8):
        display.start_round(r)
        display.phase("generating")
        time.sleep(0.1)
        display.round({"round": r, "reward_mean": 0.5}, 30)
    display.close()
    assert [line.split("  ")[0] for line in stream.getvalue().splitlines()] == [
        f"round {r}/30" for r in range(1, 8)
    ]


def test_the_live_display_shows_the_step_and_the_generation() -> None:
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=160, color_system=None)
    display = Display(30, 0, live=True, console=console)
    assert display.progress is not None
    display.step("loading smollm2-135m-instruct")
    display.status("dequantizing tensor 12/272")
    display.progress.refresh()
    frame = stream.getvalue().split("\r")[-1]
    assert "loading smollm2-135m-instruct" in frame and "dequantizing tensor 12/272" in frame
    display.start_round(1)
    display.phase("generating")
    display.generation(1, 48, 32)
    display.generation(5, 48, 32)
    display.progress.refresh()
    frame = stream.getvalue().split("\r")[-1]
    display.close()
    assert "generating" in frame and "step 5/48 x 32 responses" in frame and "tok/s" in frame


def test_the_engine_reports_each_decoding_step(tmp_path: Path) -> None:
    lrn = learner(small_spec(tmp_path, "rollout.max_new_tokens=6"))
    seen: list[tuple[int, int, int]] = []
    lrn.listen(lambda *step: seen.append(step))
    lrn.sample(["echo a", "echo b"], 3)
    assert seen[0] == (0, 6, 6)  # the prompts' forward pass begins
    assert [s[0] for s in seen] == list(range(len(seen))) and 2 <= len(seen) <= 7


def test_a_run_names_its_steps_before_the_first_round(tmp_path: Path, capsys) -> None:
    train(small_spec(tmp_path / "run", "eval.prompts=4", "eval.batch_size=2"))
    err = capsys.readouterr().err.splitlines()
    order = [
        "ppokit: building the tiny model",
        "ppokit: building the critic: a copy of the actor's trunk and a value head",
        "ppokit: starting the rollout engine (hf)",
        "ppokit: reading the prompts (demo)",
        "ppokit: evaluating 4 held-out prompts",
        "round 1/1",
    ]
    found = [next(i for i, line in enumerate(err) if line.startswith(o)) for o in order]
    assert found == sorted(found)
    # a message naming the run's folder is as long as its path; every other line fits
    assert all(len(line) <= CONSOLE_WIDTH for line in err if str(tmp_path) not in line)
    assert any(line.startswith("round 0 (before training): accuracy ") for line in err)


def test_a_smoke_run_says_that_zero_rewards_are_expected(tmp_path: Path, capsys) -> None:
    spec = small_spec(None, "reward=exact_match", "data.source=arithmetic")
    train(spec, smoke=True, smoke_out=str(tmp_path / "smoke"))
    err = capsys.readouterr().err
    assert "smoke run: 2 rounds of the spec's components on the tiny random model" in err
    assert "every reward of the smoke run was 0, as expected" in err


def test_the_summary_fits_160_columns_without_a_terminal() -> None:
    long = {f"reward/a_rather_long_reward_name_{i}": -1.234567e-300 for i in range(3)}
    history = [
        {"round": 0, "eval/accuracy": 0.35, "eval/accuracy_ci95": 0.066},
        {"round": 1, "reward_mean": -1.234567e-300, "kl": 1e300, **long},
        {"round": 2, "reward_mean": 0.5, "kl": 1e-300, **long},
    ]
    stream = io.StringIO()
    Display(2, 0, live=False, stream=stream, every=0).summary(history, "runs/" + "x" * 200)
    lines = stream.getvalue().splitlines()
    assert max(len(line) for line in lines) <= CONSOLE_WIDTH
    table = summary_table(history, "runs/x")
    assert table is not None


def test_console_width_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert console_width(io.StringIO()) == CONSOLE_WIDTH
    monkeypatch.setenv("COLUMNS", "132")
    assert console_width(io.StringIO()) == 132


def test_ppokit_list_piped_keeps_each_component_on_one_line() -> None:
    result = CliRunner().invoke(app, ["list", "reward"])
    assert result.exit_code == 0
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 + len(set(line.split()[1] for line in lines[1:]))
    assert any("your own Python function" in line for line in lines)
    assert max(len(line) for line in lines) <= CONSOLE_WIDTH


def test_print_spec_shows_the_spec_that_would_run() -> None:
    result = CliRunner().invoke(app, ["train", "--print-spec", "--set", "train.rounds=7"])
    assert result.exit_code == 0
    assert result.stdout.startswith("# ppokit train: the packaged demo spec")
    data = yaml.safe_load(result.stdout)
    spec = validate_spec(data)
    assert spec.train.rounds == 7 and spec.advantage.name == "gae"
    assert spec.train.actor_lr == load_spec(DEMO).train.actor_lr
    other = CliRunner().invoke(app, ["train", str(DEMO), "--print-spec", "--out", "runs/y"])
    assert validate_spec(yaml.safe_load(other.stdout)).output.dir == "runs/y"
    smoke = CliRunner().invoke(app, ["train", str(DEMO), "--print-spec", "--smoke"])
    assert validate_spec(yaml.safe_load(smoke.stdout)).train.rounds == 2


def test_the_gguf_conversion_bar_becomes_a_status() -> None:
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    heard: list[str] = []

    class Report:
        def status(self, text: str) -> None:
            heard.append(text)

    with _gguf_progress(Report()):
        assert list(gguf_utils.tqdm([1, 2, 3], desc="Converting")) == [1, 2, 3]
    assert gguf_utils.tqdm is original
    assert heard == [f"dequantizing tensor {i}/3 to float32" for i in (1, 2, 3)]


def test_math_verify_timeout_notice_is_dropped_and_nothing_else() -> None:
    pytest.importorskip("math_verify")
    from ppokit.components.reward.impl import MathVerifyReward

    MathVerifyReward(field="answer", correct=1.0, incorrect=0.0, final="expression")
    logger = logging.getLogger("math_verify.parser")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        logger.warning("Timeout is disabled as parsing_timeout is None or <= 0, ...")
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == "something else\n"


def test_the_time_left_is_unknown_once_a_round_outlasts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of 10 s, 2 of 3 done: 10 s left; 4 s into the last round 6 s; 15 s into it
    (an evaluation at the end) the estimate is spent, shown ``?``, never ``0s``."""
    import ppokit.trainer.display as display_module

    clock = [100.0]
    monkeypatch.setattr(display_module.time, "perf_counter", lambda: clock[0])
    display, _ = plain(every=0)
    for r in (1, 2):
        display.start_round(r)
        clock[0] += 10.0
        display.round({"round": r, "reward_mean": 0.5}, 3)
    display.start_round(3)
    display.phase("generating")
    assert display.status_line().endswith("eta 10s")
    clock[0] += 4.0
    assert display.status_line().endswith("eta 6s") and display.clock().endswith("eta 6s")
    clock[0] += 11.0
    display.phase("evaluating")
    assert display.status_line().endswith("eta ?") and display.clock().endswith("eta ?")
    display.close()


def test_vllm_log_lines_go_to_the_log_and_each_warning_to_the_display_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """vLLM's loggers (vLLM adds no handler of its own in the process): INFO and above into
    the run's library.log, nothing onto the terminal; a warning is a display message the
    first time only; the loggers are as they were after."""
    from ppokit.trainer.display import folded_logs

    display, stream = plain(every=0)
    log = tmp_path / "library.log"
    logger = logging.getLogger("vllm.engine.arg_utils")
    before = logging.getLogger("vllm").level, logging.getLogger("vllm").propagate
    with folded_logs(display, log):
        logger.info("non-default args: %s", {"dtype": "float32"})
        logger.warning("the global random seed is set to 0")
        logger.warning("the global random seed is set to 0")
        logger.debug("not kept")
    logger.warning("after the run")  # back to Python's own handling
    display.close()
    assert stream.getvalue().splitlines() == ["vllm: the global random seed is set to 0"]
    assert log.read_text().splitlines() == [
        "INFO vllm.engine.arg_utils: non-default args: {'dtype': 'float32'}",
        "WARNING vllm.engine.arg_utils: the global random seed is set to 0",
        "WARNING vllm.engine.arg_utils: the global random seed is set to 0",
    ]
    assert "non-default args" not in capfd.readouterr().err
    assert (logging.getLogger("vllm").level, logging.getLogger("vllm").propagate) == before
