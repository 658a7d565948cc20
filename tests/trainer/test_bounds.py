"""Timeouts that hold against any code: a reward that holds the interpreter in C code is
stopped at ``train.reward_timeout`` (its worker process killed), the built-in regex reward
cannot backtrack for minutes, an engine's ``generate`` and ``sync``, a group filter and a
correction are interrupted at their bounds, and Ctrl-C ends a run while a reward computes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ppokit.components.group_filter import Groups
from ppokit.components.rollout_engine import Generation, Sampling
from ppokit.errors import ComponentTimeout
from ppokit.trainer.assembly import Assembly, Checked, CheckedEngine, Where
from tests.helpers.trainer import small_spec

#: Seconds of exponential backtracking in the C matcher of ``re`` (holding the GIL), many
#: times the bounds below.
SPIN = '__import__("re").fullmatch(r"(a+)+$", "a" * 26 + "b")'

REWARD = f"""\
from pathlib import Path


def reward(prompts, responses, **fields):
    Path(__file__).with_suffix(".started").touch()
    {SPIN}
    Path(__file__).with_suffix(".finished").touch()
    return [0.0] * len(responses)
"""


@pytest.fixture
def spinning(tmp_path: Path) -> str:
    """``reward={name: python, function: FILE:reward}`` of a reward that spins in C."""
    code = tmp_path / "spins.py"
    code.write_text(REWARD)
    return f"reward={{name: python, function: '{code}:reward'}}"


def test_a_reward_holding_the_interpreter_is_stopped_at_its_timeout(
    spinning: str, tmp_path: Path
) -> None:
    asm = Assembly.from_spec(small_spec(None, spinning, "train.reward_timeout=0.5"))
    try:
        _, reward, _ = asm.rewards[0]
        with pytest.raises(ComponentTimeout) as info:
            reward(["p"], ["r"], lengths=[1], truncated=[False], transcripts=["r"])
        assert str(info.value).startswith(
            "reward (python, plugin ppokit) did not return within train.reward_timeout (0.5 s)"
        )
        assert (tmp_path / "spins.started").exists()
        assert not (tmp_path / "spins.finished").exists()  # stopped in the middle
    finally:
        asm.close()


def test_the_regex_reward_cannot_backtrack_for_minutes(use_registry) -> None:
    use_registry()
    from ppokit.registry import get_registry

    registry = get_registry()
    issue = registry.create("reward", "regex", pattern=r"^(a+)+$")  # linear in 'regex'
    assert issue(["p"], ["a" * 5000 + "b", "aaa"]).tolist() == [0.0, 1.0]
    worst = registry.create("reward", "regex", pattern=r"(a|aa)+$", timeout=0.2)
    assert worst(["p"], ["a" * 60 + "b", "b"]).tolist() == [0.0, 0.0]  # over its timeout: 0


class Stuck:
    """An engine and a group filter that never return (Python code)."""

    def __init__(self, seconds: float = 120.0) -> None:
        self.seconds = seconds

    def start(self, context: Any) -> None: ...

    def generate(self, ids: torch.Tensor, mask: torch.Tensor, sampling: Sampling) -> Generation:
        time.sleep(self.seconds)
        raise AssertionError("not reached")

    def sync(self) -> None:
        while True:
            pass

    def __call__(self, groups: Groups) -> torch.Tensor:
        time.sleep(self.seconds)
        raise AssertionError("not reached")


def test_an_engine_call_is_interrupted_at_its_timeout() -> None:
    engine = CheckedEngine(Where("rollout.engine", "stuck", "test"), Stuck(), 0.3)
    ids = torch.ones(1, 2, dtype=torch.long)
    with pytest.raises(ComponentTimeout) as info:
        engine.generate(ids, ids, Sampling())
    assert str(info.value) == (
        "rollout.engine (stuck, plugin test) did not return from generate within "
        "rollout.engine_timeout (0.3 s): it was interrupted and the run stops"
    )
    with pytest.raises(ComponentTimeout, match=r"from sync within rollout\.engine_timeout"):
        engine.sync()


def test_a_group_filter_is_interrupted_at_its_timeout() -> None:
    where = Where("rollout.filter", "stuck", "test")
    keep = Checked("group_filter", where, Stuck(), 0.3)
    groups = Groups([{}], ["a"], torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1, 1, dtype=bool))
    with pytest.raises(ComponentTimeout, match=r"within train\.component_timeout \(0\.3 s\)"):
        keep(groups)


@pytest.fixture
def interrupt_when(tmp_path: Path, ctrl_c: None) -> Iterator[Callable[[Path], None]]:
    """``interrupt_when(path)``: SIGINT to this process once ``path`` exists."""
    stop = threading.Event()

    def watch(path: Path) -> None:
        def run() -> None:
            while not stop.is_set():
                if path.exists():
                    os.kill(os.getpid(), signal.SIGINT)
                    return
                time.sleep(0.02)

        threading.Thread(target=run, daemon=True).start()

    yield watch
    stop.set()


def test_ctrl_c_ends_a_run_while_a_reward_computes(
    spinning: str, tmp_path: Path, interrupt_when: Callable[[Path], None]
) -> None:
    from ppokit.trainer.lifecycle.ending import Interrupted
    from ppokit.trainer.loop import train

    spec = small_spec(tmp_path / "run", spinning, "train.reward_timeout=600")
    interrupt_when(tmp_path / "spins.started")
    with pytest.raises(Interrupted) as info:
        train(spec)
    assert info.value.round == 1
    assert not (tmp_path / "spins.finished").exists()  # the reward did not get to finish
