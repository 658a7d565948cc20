"""The output folder is safe: ``--overwrite`` empties only a ppokit run (its marker), a second
run on a folder refuses (a lock the OS releases on any exit), ``--resume`` refuses a spec that
changes the objective unless the change is asked for (and recorded), a checkpoint that
disagrees with the metrics is refused, a non-finite state is never saved, and OS errors are
one line naming the path and the cause, the last good checkpoint intact."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from typer.testing import CliRunner

import ppokit.runfolder as runfolder
import ppokit.trainer.checkpoint as checkpoint_module
import ppokit.trainer.checkpoint.write as checkpoint_writer
import ppokit.trainer.loop as loop_module
import ppokit.trainer.run as run_module
from ppokit.cli import app
from ppokit.errors import UserError
from ppokit.runfolder import (
    CHECKPOINT,
    LOCK,
    MARKER,
    RUN_FILES,
    SPEC_CHANGES,
    FolderLock,
    RunFolder,
    check_metrics,
    io_error,
    read_metrics,
)
from ppokit.spec_changes import spec_differences
from ppokit.trainer import train
from ppokit.trainer.checkpoint import NonFiniteCheckpointError, check_finite, read_state
from tests.helpers.trainer import DEMO, SMALL, learner, run_fixtures, small_spec

RUN = ["train.rounds=2", "output.save_every=1"]
ROOT = Path(__file__).resolve().parents[2]


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert message and "\n" not in message
    return message


trained, run = run_fixtures(*RUN, after=lambda out: (out / LOCK).unlink(missing_ok=True))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK
    }


# ---------------------------------------------------------------- 7. what --overwrite removes
def test_a_run_folder_carries_its_marker(run: Path) -> None:
    marker = json.loads((run / MARKER).read_text())
    assert marker["ppokit"] and marker["created"]
    assert MARKER in RUN_FILES


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_that_was_never_a_run_is_refused_and_left_alone(
    tmp_path: Path, overwrite: bool
) -> None:
    (tmp_path / "thesis.tex").write_text("years of work")
    (tmp_path / "metrics.jsonl").write_text("mine, not ppokit's\n")  # a run's name, no marker
    (tmp_path / "checkpoint").mkdir()
    before = snapshot(tmp_path)
    with pytest.raises(UserError) as info:
        train(small_spec(tmp_path), overwrite=overwrite)
    message = one_line(info)
    assert "not a ppokit run folder" in message and str(tmp_path) in message
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint",
        "metrics.jsonl",
        "thesis.tex",
    ]


def test_overwrite_removes_only_what_a_run_wrote(run: Path) -> None:
    (run / "notes.txt").write_text("mine")
    (run / "plots").mkdir()
    (run / "plots" / "a.png").write_bytes(b"png")
    with pytest.raises(UserError, match="--resume to continue it or --overwrite"):
        RunFolder(run, resume=False, overwrite=False).open()
    old_marker = (run / MARKER).read_text()
    time.sleep(1.1)  # a new creation time
    with RunFolder(run, resume=False, overwrite=True):
        left = sorted(p.name for p in run.iterdir())
    assert left == sorted([LOCK, MARKER, "notes.txt", "plots"])
    assert (run / MARKER).read_text() != old_marker
    assert (run / "plots" / "a.png").read_bytes() == b"png"


def test_the_marker_is_written_before_anything_else(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "new"

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("model failed to load")

    monkeypatch.setattr(run_module, "build_models", broken)
    with pytest.raises(RuntimeError):
        train(small_spec(out))
    assert sorted(p.name for p in out.iterdir()) == [LOCK, MARKER]
    monkeypatch.undo()
    train(small_spec(out))  # an empty run is started again without --overwrite
    assert len(read_metrics(out)) == 1


def test_empty_folders_and_files(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with RunFolder(tmp_path / "empty", resume=False, overwrite=False):
        assert (tmp_path / "empty" / MARKER).is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        RunFolder(tmp_path / "file", resume=False, overwrite=True).open()
    with pytest.raises(UserError, match="nothing to resume"):
        RunFolder(tmp_path / "absent", resume=True, overwrite=False).open()
    assert not (tmp_path / "absent").exists()


def test_a_run_of_an_older_ppokit_without_marker_resumes(run: Path) -> None:
    (run / MARKER).unlink()
    with pytest.raises(UserError, match="not a ppokit run folder"):
        train(small_spec(run, *RUN), overwrite=True)  # without the marker: never emptied
    result = train(small_spec(run, "train.rounds=3", "output.save_every=1"), resume=True)
    assert result["resumed_from"] == 2 and (run / MARKER).is_file()


# ---------------------------------------------------------------- 8. one run per folder
HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ppokit.runfolder import RunFolder
    folder = RunFolder(Path(sys.argv[1]), resume=False, overwrite=False)
    folder.open()  # held while the object lives
    print("locked", flush=True)
    time.sleep(120)
    """
)


def hold(folder: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_second_run_refuses_and_a_killed_runs_lock_is_free(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = hold(out)
    try:
        with pytest.raises(UserError) as info:
            train(small_spec(out))
        message = one_line(info)
        assert "in use by another ppokit run" in message and str(out / LOCK) in message
        with pytest.raises(UserError, match="in use"):
            train(small_spec(out), overwrite=True)  # overwrite never removes a live run
        with pytest.raises(UserError, match="in use"):
            RunFolder(out, resume=True, overwrite=False).open()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert (out / LOCK).exists()  # the lock file is left behind, its lock is not
    train(small_spec(out))
    assert len(read_metrics(out)) == 1


def test_the_lock_is_released_on_any_exit(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "run"
    train(small_spec(out))
    with RunFolder(out, resume=False, overwrite=True), pytest.raises(UserError, match="in use"):
        RunFolder(out, resume=False, overwrite=True).open()  # within one process too

    def boom(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(loop_module, "run_round", boom)
    with pytest.raises(KeyboardInterrupt):
        train(small_spec(out), overwrite=True)
    with RunFolder(out, resume=False, overwrite=True):  # free again
        pass


def test_the_lock_is_filelocks_and_never_follows_a_link(tmp_path: Path) -> None:
    lock = FolderLock(tmp_path)
    lock.acquire()
    assert FolderLock(tmp_path).held_elsewhere()
    with pytest.raises(UserError, match="in use"):
        FolderLock(tmp_path).acquire()
    lock.release()
    assert not FolderLock(tmp_path).held_elsewhere()
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep")
    (tmp_path / LOCK).unlink()
    (tmp_path / LOCK).symlink_to(target)
    lock.acquire()  # the link is replaced by a lock file of its own
    assert not (tmp_path / LOCK).is_symlink() and target.read_text() == "keep"
    lock.release()


# ---------------------------------------------------------------- 9. resume with another spec
def test_spec_differences_ignore_what_does_not_change_the_objective() -> None:
    a = small_spec(None).model_dump()
    b = small_spec(
        None,
        "output.dir=elsewhere",
        "output.progress=true",
        "train.rounds=50",
        "model.device=cpu",
        "model.threads=3",
    ).model_dump()
    assert spec_differences(a, b) == []
    c = small_spec(None, "seed=3", "advantage.lam=0.9", "kl.coef=0.1").model_dump()
    keys = [k for k, _, _ in spec_differences(a, c)]
    assert keys == ["seed", "advantage.lam", "kl"]


@pytest.mark.parametrize(
    ("extra", "key"),
    [(["seed=7"], "seed"), (["advantage.lam=0.5"], "advantage.lam"), (["kl.coef=0.2"], "kl")],
)
def test_resume_with_a_different_objective_is_refused(run: Path, extra, key: str) -> None:
    before = snapshot(run)
    with pytest.raises(UserError) as info:
        train(small_spec(run, "train.rounds=3", *extra), resume=True)
    message = one_line(info)
    assert f"{key}" in message and "--allow-spec-change" in message
    assert snapshot(run) == before


def test_extending_a_run_and_changing_free_keys_resumes(run: Path) -> None:
    changed = ("output.save_every=5", "model.threads=2", "health.entropy=0.05")
    result = train(small_spec(run, "train.rounds=3", *changed), resume=True)
    assert result["resumed_from"] == 2 and result["rounds"] == 3
    assert not (run / SPEC_CHANGES).exists()


def test_a_deliberate_change_is_recorded(run: Path) -> None:
    runner = CliRunner()
    args = ["train", str(DEMO), *[a for s in SMALL for a in ("--set", s)], "--out", str(run)]
    args += ["--set", "train.rounds=3", "--set", "advantage.lam=0.8", "--resume"]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 1 and "advantage.lam: 0.95 -> 0.8" in refused.stderr
    done = runner.invoke(app, [*args, "--allow-spec-change"])
    assert done.exit_code == 0, done.stderr
    (line,) = (run / SPEC_CHANGES).read_text().splitlines()
    record = json.loads(line)
    assert record["round"] == 2 and record["keys"] == ["advantage.lam"]
    assert record["old"] == {"advantage.lam": 0.95} and record["new"] == {"advantage.lam": 0.8}
    assert "lam: 0.8" in (run / "spec.yaml").read_text()
    assert [h["round"] for h in read_metrics(run)] == [1, 2, 3]
    again = runner.invoke(app, [*args[:-3], "--set", "train.rounds=4", "--set",
                                "advantage.lam=0.8", "--resume"])  # fmt: skip
    assert again.exit_code == 0, again.stderr  # the run's spec is now the changed one


# ---------------------------------------------------------------- 10. checkpoint vs metrics
def test_metrics_after_the_checkpoint_are_redone(run: Path) -> None:
    metrics = run / "metrics.jsonl"
    with metrics.open("a") as fh:
        fh.write('{"round": 3, "reward_mean": 9.0}\n{"round": 4, "rew')  # and a cut line
    assert check_metrics(metrics, 2) == [3]
    train(small_spec(run, "train.rounds=3", "output.save_every=1"), resume=True)
    assert [h["round"] for h in read_metrics(run)] == [1, 2, 3]
    assert read_metrics(run)[-1]["reward_mean"] != 9.0


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        ("cut", "ends at round 1"),
        ("missing", "does not exist"),
        ("hole", "lacks round(s) 1"),
    ],
)
def test_a_checkpoint_beyond_the_metrics_is_refused(run: Path, damage: str, fragment: str) -> None:
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    if damage == "cut":
        metrics.write_text(lines[0] + "\n")
    elif damage == "missing":
        metrics.unlink()
    else:
        metrics.write_text(lines[1] + "\n")
    before = snapshot(run)
    with pytest.raises(UserError) as info:
        train(small_spec(run, "train.rounds=3", "output.save_every=1"), resume=True)
    message = one_line(info)
    assert fragment in message and "checkpoint is at round 2" in message
    assert snapshot(run) == before


def test_a_non_finite_state_is_never_saved(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "run"
    real = loop_module.run_round

    def diverge(setup, state, produced, *, round_no, **kw):  # type: ignore[no-untyped-def]
        result = real(setup, state, produced, round_no=round_no, **kw)
        if round_no == 2:
            with torch.no_grad():
                next(setup.models.actor.parameters()).view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(loop_module, "run_round", diverge)
    with pytest.raises(NonFiniteCheckpointError) as info:
        train(small_spec(out, *RUN))
    message = one_line(info)
    assert "round 2: not saving a checkpoint: actor " in message and "NaN or inf" in message
    assert "last good checkpoint (round 1)" in message
    assert read_state(out)["round"] == 1
    assert not (out / f".{CHECKPOINT}.tmp").exists()


def test_a_non_finite_optimizer_state_is_named() -> None:
    lrn = learner(small_spec(None))
    check_finite(lrn.setup.models, lrn.state.optimizers)
    param = next(lrn.setup.models.actor.parameters())
    lrn.state.optimizers.actor.state[param] = {"exp_avg": torch.full_like(param, float("inf"))}
    with pytest.raises(NonFiniteCheckpointError, match="optimizer's exp_avg of actor"):
        check_finite(lrn.setup.models, lrn.state.optimizers)


# ---------------------------------------------------------------- 11. OS errors
def enospc(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fail_on_round(monkeypatch, name: str, round_no: int, error=enospc, owner=None) -> None:  # type: ignore[no-untyped-def]
    """Make ``owner.name`` (default: the checkpoint writer's) fail while the checkpoint of
    ``round_no`` is written."""
    owner = checkpoint_writer if owner is None else owner
    real_save = checkpoint_module.save_checkpoint
    real = getattr(owner, name)
    current = {"round": 0}

    def save(out, models, state, source, round_done, spec_yaml, *more):  # type: ignore[no-untyped-def]
        current["round"] = round_done
        return real_save(out, models, state, source, round_done, spec_yaml, *more)

    def write(*args, **kwargs):  # type: ignore[no-untyped-def]
        if current["round"] == round_no:
            return error(*args, **kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "save_checkpoint", save)
    monkeypatch.setattr(owner, name, write)


def safetensors_error(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise SafetensorError(  # as safetensors 0.8 reports a full disk
        "Error while serializing: I/O error: No space left on device (os error 28) at path "
        '"run/.checkpoint.tmp/.tmpX"'
    )


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("save_file", enospc),
        ("save_file", safetensors_error),
        ("_fsync", enospc),
        ("create_stream", enospc),  # inside torch.distributed.checkpoint's writer
    ],
)
def test_disk_full_while_saving_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch, name: str, error
) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.filesystem import FileSystem

    out = tmp_path / "run"
    fail_on_round(monkeypatch, name, 2, error, FileSystem if name == "create_stream" else None)
    with pytest.raises(UserError) as info:
        train(small_spec(out, *RUN))
    message = one_line(info)
    assert "(no space left on device)" in message and str(out) in message
    assert "checkpoint of round 2" in message and "checkpoint (round 1) is kept" in message
    assert read_state(out)["round"] == 1  # verified: every checksum
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".checkpoint")) == []


def test_a_failed_swap_puts_the_previous_checkpoint_back(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "run"
    real = Path.rename
    calls = []

    def rename(self: Path, target):  # type: ignore[no-untyped-def]
        if self.name == f".{CHECKPOINT}.tmp":
            calls.append(self)
            if len(calls) == 2:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(target))
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(UserError, match=r"\(permission denied\); the last good checkpoint"):
        train(small_spec(out, *RUN))
    assert read_state(out)["round"] == 1
    assert not any(p.name.startswith(".checkpoint") for p in out.iterdir())


def test_disk_full_while_writing_metrics_leaves_no_partial_line(
    tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "run"
    real = os.write

    def write(fd: int, data: bytes) -> int:
        if data.startswith(b'{"round": 2'):
            real(fd, data[:10])  # part of it reached the disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(UserError) as info:
        train(small_spec(out, *RUN))
    monkeypatch.undo()
    message = one_line(info)
    assert message == f"{out / 'metrics.jsonl'}: cannot write (no space left on device)"
    assert [h["round"] for h in read_metrics(out)] == [1]
    assert (out / "metrics.jsonl").read_text().endswith("}\n")  # no partial line
    assert read_state(out)["round"] == 1
    train(small_spec(out, "train.rounds=2", "output.save_every=1"), resume=True)
    assert [h["round"] for h in read_metrics(out)] == [1, 2]


def test_a_read_only_parent_is_one_line(tmp_path: Path, monkeypatch) -> None:
    def mkdir(self: Path, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(UserError) as info:
        train(small_spec(tmp_path / "run"))
    assert one_line(info) == (
        f"{tmp_path / 'run'}: cannot create the output folder (read-only file system)"
    )


def test_spec_yaml_write_error_is_one_line(tmp_path: Path, monkeypatch) -> None:
    real = runfolder.open_new

    def open_new(path: Path):  # type: ignore[no-untyped-def]
        if path.name == "spec.yaml.tmp":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path)

    monkeypatch.setattr(runfolder.files, "open_new", open_new)
    with pytest.raises(UserError, match=r"spec\.yaml\.tmp: cannot write \(permission denied\)"):
        train(small_spec(tmp_path / "run"))
    assert not (tmp_path / "run" / "spec.yaml.tmp").exists()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores chmod")
def test_a_read_only_run_folder(run: Path) -> None:
    before = snapshot(run)
    run.chmod(0o555)
    try:
        with pytest.raises(UserError) as info:
            train(small_spec(run, "train.rounds=3", "output.save_every=1"), resume=True)
        assert "(permission denied)" in one_line(info)
    finally:
        run.chmod(0o755)
    assert snapshot(run) == before


def test_io_error_messages() -> None:
    rust = SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")
    assert str(io_error("x", rust)) == "x: cannot write (permission denied)"
    exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(io_error("a/b", exc)) == "a/b: cannot write (no space left on device)"
    exc = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "a/c")
    assert str(io_error("a", exc, "cannot read")) == "a/c: cannot read (permission denied)"
