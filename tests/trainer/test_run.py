"""Whole runs: resume equivalence, output-directory safety, bad checkpoints, smoke, demo."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from ppokit.errors import UserError
from ppokit.spec import load_spec, validate_spec
from ppokit.trainer import loop, train
from ppokit.trainer.lifecycle import ending
from ppokit.trainer.lifecycle.smoke import SMOKE_PREFIX, TEMPORARY, smoke_spec
from ppokit.trainer.metrics import TIMING, read_metrics
from tests.helpers.trainer import DEMO, small_spec

RUN = ["rollout.n=4", "train.minibatch_size=4", "train.micro_batch_size=2", "train.ppo_epochs=2"]


def _untimed(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in TIMING} for h in history]


@pytest.mark.slow
def test_resume_reproduces_an_uninterrupted_run(tmp_path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    extra = [*RUN, "kl.coef=0.05", "kl.target=0.5", "train.warmup_steps=3"]
    train(small_spec(whole, "train.rounds=4", *extra))
    train(small_spec(split, "train.rounds=2", "output.save_every=1", *extra))
    (split / "metrics.jsonl").open("a").write('{"round": 3, "reward_mean": 9.0}\n')  # stale
    result = train(small_spec(split, "train.rounds=4", *extra), resume=True)
    assert result["resumed_from"] == 2
    a, b = read_metrics(whole), read_metrics(split)
    assert [h["round"] for h in b] == [1, 2, 3, 4]
    assert _untimed(a) == _untimed(b)


def test_refuses_a_non_empty_output_dir(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not empty"):
        train(small_spec(tmp_path))
    with pytest.raises(UserError, match="not a ppokit run folder"):
        train(small_spec(tmp_path), overwrite=True)  # never emptied: it was never a run
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    run = tmp_path / "run"
    train(small_spec(run))
    (run / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not empty"):
        train(small_spec(run))
    train(small_spec(run), overwrite=True)  # a run: replaced, the user's file kept
    assert (run / "notes.txt").read_text() == "keep me"
    assert len(read_metrics(run)) == 1


def test_resume_without_checkpoint_is_a_user_error(tmp_path) -> None:
    with pytest.raises(UserError, match="nothing to resume"):
        train(small_spec(tmp_path), resume=True)


@pytest.mark.parametrize("damage", ["weights", "state", "incompatible"])
def test_bad_checkpoint_is_a_user_error_and_loses_nothing(tmp_path, damage: str) -> None:
    train(small_spec(tmp_path, "train.rounds=2"))
    ckpt = tmp_path / "checkpoint"
    metrics_before = (tmp_path / "metrics.jsonl").read_text()
    if damage == "weights":
        next((ckpt / "actor").glob("*.safetensors")).write_bytes(b"not a safetensors file")
    elif damage == "state":
        (ckpt / "state.json").write_text("{")
    files_before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    overrides = ["train.rounds=3"]
    if damage == "incompatible":
        overrides.append("model.tiny.hidden_size=48")
    with pytest.raises(UserError, match="checkpoint"):
        train(small_spec(tmp_path, *overrides), resume=True)
    assert (tmp_path / "metrics.jsonl").read_text() == metrics_before
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == files_before


def test_checkpoint_contents(tmp_path) -> None:
    train(small_spec(tmp_path, "train.rounds=2", "output.save_every=1", "kl.coef=0.1"))
    ckpt = tmp_path / "checkpoint"
    names = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    shard = "shard-00001-model-00001-of-00001.safetensors"  # one process: one file each
    assert names == {
        f"actor/{shard}",
        f"critic/{shard}",
        f"optim/{shard}",
        "optim.json",
        "rng/process-00000.json",
        "rng/process-00000.safetensors",
        "manifest.json",
        "state.json",
        "spec.yaml",
    }
    state = json.loads((ckpt / "state.json").read_text())
    assert state["round"] == 2 and state["kl_coef"] == pytest.approx(0.1)
    assert not any(p.name.startswith(".checkpoint") for p in tmp_path.iterdir())


def test_smoke_runs_two_small_rounds(tmp_path, monkeypatch, capsys) -> None:
    spec = load_spec(
        DEMO,
        [
            f"output.dir={tmp_path / 'real'}",
            "output.progress=false",
            "data.source=arithmetic",
            "data.chat_template=true",
            "reward=math_verify",
            "advantage=rloo",
            "critic=null",
            "rollout.n=8",
            "rollout.prompts_per_round=8",
            "train.minibatch_size=16",
            "train.micro_batch_size=8",
        ],
    )
    made = _record_mkdtemp(monkeypatch, tmp_path)
    seen: list[list[dict]] = []
    real_plot = ending.plot_curves

    def plot(history: list[dict], *args: object, **kwargs: object) -> None:
        seen.append(read_metrics(made[0]))  # the run's own records, before the end
        real_plot(history, *args, **kwargs)

    monkeypatch.setattr(ending, "plot_curves", plot)
    result = train(spec, smoke=True)
    [history] = seen
    assert result["smoke"] and [h["round"] for h in history] == [1, 2]
    assert not (tmp_path / "real").exists()  # the spec's own output is untouched
    assert all(h["response_length_mean"] <= 8 for h in history)
    assert len(made) == 1 and Path(made[0]).name.startswith(SMOKE_PREFIX)
    assert not Path(made[0]).exists() and result["output_dir"] is None  # removed at the end
    err = capsys.readouterr().err
    assert made[0] not in err and TEMPORARY in err  # no line names the removed folder


def _record_mkdtemp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """The folders ``tempfile.mkdtemp`` makes from now on (under tmp_path)."""
    made: list[str] = []
    real = tempfile.mkdtemp

    def mkdtemp(*args: object, **kwargs: object) -> str:
        made.append(real(*args, dir=tmp_path, **kwargs))  # type: ignore[call-overload]
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return made


@pytest.mark.parametrize("stop", [UserError("disk full"), KeyboardInterrupt()])
def test_a_smoke_run_that_stops_removes_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: BaseException
) -> None:
    made = _record_mkdtemp(monkeypatch, tmp_path)
    written: list[bool] = []

    def fail(place: Any, run: object) -> None:
        out = place.out
        written.append((out / "spec.yaml").exists() or any(out.iterdir()))
        raise stop

    monkeypatch.setattr(loop, "restore", fail)
    with pytest.raises(type(stop)):
        train(small_spec(None), smoke=True)
    assert len(made) == 1 and written == [True]  # the folder was the run's
    assert not Path(made[0]).exists()


def test_a_smoke_run_keeps_the_folder_it_was_given(tmp_path: Path) -> None:
    out = tmp_path / "smoke"
    result = train(small_spec(None), smoke=True, smoke_out=str(out))
    assert result["output_dir"] == str(out)
    assert [h["round"] for h in read_metrics(out)] == [1, 2]


def test_the_smoke_model_has_heads_of_32_dimensions(tmp_path: Path) -> None:
    tiny = smoke_spec(validate_spec({}), str(tmp_path)).model.tiny
    assert (tiny.num_attention_heads, tiny.num_key_value_heads) == (2, 2)
    assert tiny.hidden_size // tiny.num_attention_heads == 32
    assert smoke_spec(load_spec(DEMO), str(tmp_path)).model.tiny == load_spec(DEMO).model.tiny
    own = {
        "model": {"tiny": {"hidden_size": 48, "num_attention_heads": 1, "num_key_value_heads": 1}}
    }
    kept = smoke_spec(validate_spec(own), str(tmp_path)).model.tiny  # the spec's own
    assert (kept.hidden_size, kept.num_attention_heads, kept.num_key_value_heads) == (48, 1, 1)
    wide = smoke_spec(validate_spec({"model": {"tiny": {"hidden_size": 128}}}), str(tmp_path))
    wide = wide.model.tiny
    assert (wide.hidden_size, wide.num_attention_heads) == (128, 2)  # the rest stays the smoke's
