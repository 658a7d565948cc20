"""User code cannot end a run silently: ``sys.exit(0)``, ``KeyboardInterrupt`` or any
``BaseException`` raised by a component, and a worker process that dies, stop the run with a
non-zero status and one line naming the slot, the component, its plugin and the file:line of
the code, the last good checkpoint kept; a component's ordinary exception is that one line
too, with its traceback behind ``--traceback``; and a run that finished and saved is a
success even if the engine's ``close`` then fails."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ppokit.bounded import counting_interrupts
from ppokit.cli import app
from ppokit.components.group_filter import Groups
from ppokit.components.rollout_engine.impl import HFEngine
from ppokit.errors import ComponentError
from ppokit.trainer.assembly import Checked, Where
from ppokit.trainer.checkpoint import checkpoint_round
from tests.helpers import Plugin
from tests.helpers.trainer import SMALL, small_spec

pytestmark = pytest.mark.usefixtures("clean_registry")

DEMO = str(Path(__file__).resolve().parents[2] / "ppokit" / "specs" / "demo.yaml")

#: A reward that ends the program in its second call (round 2).
EXITS = """\
import sys

calls = []


def reward(prompts, responses, **fields):
    calls.append(1)
    if len(calls) == 2:
        sys.exit(0)
    return [0.5] * len(responses)
"""


class Strange(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


def raiser(exc: BaseException) -> Callable[..., Any]:
    def reward(prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
        raise exc

    return reward


def dies(prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
    os._exit(0)


def run(tmp_path: Path, reward: Path, *flags: str) -> Any:
    """``ppokit FLAGS train`` of two small rounds with a python reward in ``reward`` (the
    switches the flags set in the environment are the ``switches`` fixture's to undo)."""
    items = [*SMALL, "train.rounds=2", "output.save_every=1"]
    items.append(f"reward={{name: python, function: '{reward}:reward'}}")
    sets = [a for item in items for a in ("--set", item)]
    argv = [*flags, "train", DEMO, *sets, "--out", str(tmp_path / "run")]
    return CliRunner().invoke(app, argv, catch_exceptions=False)


@pytest.fixture
def switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-plugins and --traceback set PPOKIT_NO_PLUGINS and PPOKIT_TRACEBACK in this
    process's environment: taken back after the test."""
    monkeypatch.setenv("PPOKIT_NO_PLUGINS", "0")
    monkeypatch.setenv("PPOKIT_TRACEBACK", "0")


@pytest.mark.usefixtures("switches")
def test_sys_exit_in_a_reward_stops_the_run_with_one_line(tmp_path: Path) -> None:
    code = tmp_path / "exits.py"
    code.write_text(EXITS)
    result = run(tmp_path, code, "--no-plugins")
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: reward (python, plugin ppokit) failed: SystemExit: 0 (at {code}:9); the last "
        f"checkpoint is round 1 ({tmp_path / 'run' / 'checkpoint'})"
    ], result.stderr
    assert "Traceback" not in result.stderr
    assert checkpoint_round(tmp_path / "run") == 1  # round 1's checkpoint stays


@pytest.mark.usefixtures("switches")
def test_the_traceback_is_behind_a_flag(tmp_path: Path) -> None:
    code = tmp_path / "exits.py"
    code.write_text(EXITS)
    result = run(tmp_path, code, "--no-plugins", "--traceback")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "in the worker process:" in result.stderr
    assert f'File "{code}", line 9, in reward' in result.stderr


@pytest.mark.parametrize("timeout", ["5", "null"])  # in a worker process, and here
@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (SystemExit(0), "SystemExit: 0"),
        (KeyboardInterrupt(), "KeyboardInterrupt"),
        (GeneratorExit(), "GeneratorExit"),
        (Strange("odd"), "Strange: odd"),
        (ValueError("bad"), "ValueError: bad"),
    ],
)
def test_whatever_a_reward_raises_is_one_line_naming_it(
    use_registry: Callable[..., Any], timeout: str, exc: BaseException, line: str
) -> None:
    from ppokit.trainer.assembly import Assembly

    use_registry(Plugin().add("reward", "raises", lambda: raiser(exc), summary="raises"))
    spec = small_spec(None, "reward.name=raises", f"train.reward_timeout={timeout}")
    asm = Assembly.from_spec(spec)
    try:
        _, reward, _ = asm.rewards[0]
        with counting_interrupts(), pytest.raises(ComponentError) as info:
            reward(["p"], ["r"], lengths=[1], truncated=[False], transcripts=["r"])
    finally:
        asm.close()
    where = f"{__file__}:{raiser.__code__.co_firstlineno + 2}"
    if timeout == "null":
        where = os.path.relpath(where)
    assert str(info.value) == f"reward (raises, plugin test0) failed: {line} (at {where})"


def test_a_worker_that_dies_is_named(use_registry: Callable[..., Any]) -> None:
    from ppokit.trainer.assembly import Assembly

    use_registry(Plugin().add("reward", "dies", lambda: dies, summary="dies"))
    asm = Assembly.from_spec(small_spec(None, "reward.name=dies"))
    try:
        _, reward, _ = asm.rewards[0]
        with pytest.raises(ComponentError) as info:
            reward(["p"], ["r"], lengths=[1], truncated=[False], transcripts=["r"])
    finally:
        asm.close()
    assert str(info.value) == (
        "reward (dies, plugin test0) failed: its worker process ended with status 0 (its code: "
        f"{__file__}:{dies.__code__.co_firstlineno})"
    )


def test_a_group_filters_exception_is_one_line() -> None:
    def keep(groups: Groups) -> torch.Tensor:
        return groups.rewards[5]  # an IndexError

    where = Where("rollout.filter", "broken", "test")
    groups = Groups([{}], ["a"], torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2, dtype=bool))
    with pytest.raises(ComponentError) as info:
        Checked("group_filter", where, keep, 5.0)(groups)
    text = str(info.value)
    assert text.startswith("rollout.filter (broken, plugin test) failed: IndexError: index 5 ")
    assert text.endswith(f"test_user_code.py:{keep.__code__.co_firstlineno + 1})")


class ClosesBadly(HFEngine):
    def close(self) -> None:
        raise RuntimeError("the engine's server is gone")


def test_a_finished_run_is_a_success_when_close_fails(
    use_registry: Callable[..., Any], tmp_path: Path
) -> None:
    from ppokit.components.rollout_engine import HFParams
    from ppokit.trainer.loop import train

    engine = Plugin().add(
        "rollout_engine", "closes_badly", ClosesBadly, params=HFParams, summary="hf"
    )
    use_registry(engine)
    spec = small_spec(tmp_path / "run", "rollout.engine.name=closes_badly")
    result = train(spec)
    assert result["rounds"] == 1 and checkpoint_round(tmp_path / "run") == 1
