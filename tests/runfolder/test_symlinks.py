"""A run folder someone else shaped never makes ppokit write through a link: temporary names
and the lock that are links are replaced (the link itself), a run whose own files are links
is not resumed (one line naming the link), ``--overwrite`` removes links and never what they
point to, and nothing outside the folder changes (content and modification time)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ppokit.errors import UserError
from ppokit.runfolder import (
    CHECKPOINT,
    CHECKPOINT_OLD,
    CHECKPOINT_TMP,
    LOCK,
    RunFolder,
    append_line,
    ensure_dir,
    read_metrics,
    remove,
    write_atomic,
)
from ppokit.trainer import train
from ppokit.trainer.checkpoint import read_state
from ppokit.trainer.metrics import plot_curves
from tests.helpers.trainer import run_fixtures, small_spec

RUN = ["train.rounds=2", "output.save_every=1", "output.sample_every=1"]
MORE = ["train.rounds=3", "output.save_every=1", "output.sample_every=1"]

pytestmark = pytest.mark.skipif(not hasattr(os, "symlink") or os.name != "posix", reason="POSIX")


trained, run = run_fixtures(*RUN, symlinks=True)


class Outside:
    """A file and a folder outside the run; :meth:`unchanged` checks nothing touched them."""

    def __init__(self, root: Path) -> None:
        root.mkdir()
        self.file = root / "precious.txt"
        self.file.write_text("years of work\n")
        self.folder = root / "folder"
        self.folder.mkdir()
        (self.folder / "inside.txt").write_text("keep me\n")
        self.before = self._state()

    def _state(self) -> dict[str, tuple[bytes, int]]:
        root = self.file.parent
        return {
            str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }

    def unchanged(self) -> bool:
        return self._state() == self.before


@pytest.fixture
def outside(tmp_path: Path) -> Outside:
    return Outside(tmp_path / "outside")


def one_line(info: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(info.value)
    assert message and "\n" not in message
    return message


# ---------------------------------------------------------------- the helpers
def test_write_atomic_replaces_a_link_and_never_writes_through_its_temp_name(
    tmp_path: Path, outside: Outside
) -> None:
    target = tmp_path / "spec.yaml"
    target.symlink_to(outside.file)
    (tmp_path / "spec.yaml.tmp").symlink_to(outside.file)
    write_atomic(target, "fresh\n")
    assert not target.is_symlink() and target.read_text() == "fresh\n"
    assert not (tmp_path / "spec.yaml.tmp").exists()
    assert outside.unchanged()


def test_append_line_refuses_a_link(tmp_path: Path, outside: Outside) -> None:
    (tmp_path / "metrics.jsonl").symlink_to(outside.file)
    with pytest.raises(UserError) as info:
        append_line(tmp_path / "metrics.jsonl", '{"round": 1}')
    assert "symbolic link" in one_line(info) and "metrics.jsonl" in one_line(info)
    assert outside.unchanged()


def test_remove_takes_the_link_not_its_target(tmp_path: Path, outside: Outside) -> None:
    (tmp_path / "a").symlink_to(outside.folder)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "c").symlink_to(outside.folder)
    remove(tmp_path / "a")
    remove(tmp_path / "b")
    assert sorted(tmp_path.iterdir()) == [outside.file.parent]
    assert outside.unchanged()


def test_ensure_dir_refuses_a_link(tmp_path: Path, outside: Outside) -> None:
    (tmp_path / "logs").symlink_to(outside.folder)
    with pytest.raises(UserError, match="logs is a symbolic link"):
        ensure_dir(tmp_path, "logs", "spec")
    assert outside.unchanged() and not (outside.folder / "spec").exists()


def test_curves_never_written_through_a_link(tmp_path: Path, outside: Outside) -> None:
    (tmp_path / "curves.png.tmp").symlink_to(outside.file)
    (tmp_path / "curves.png").symlink_to(outside.file)
    plot_curves([{"round": 1, "reward_mean": 0.5}], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "curves.png").is_symlink()
    assert outside.unchanged()


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize(
    "name",
    [LOCK, "metrics.jsonl.tmp", "spec.yaml.tmp", "samples.jsonl.tmp", "curves.png.tmp"],
)
def test_a_temporary_name_that_is_a_link_is_replaced_on_resume(
    run: Path, outside: Outside, name: str
) -> None:
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(outside.file)
    train(small_spec(run, *MORE), resume=True)
    assert [h["round"] for h in read_metrics(run)] == [1, 2, 3]
    assert outside.unchanged()


@pytest.mark.parametrize("name", [CHECKPOINT_TMP, CHECKPOINT_OLD])
def test_a_checkpoint_temp_folder_that_is_a_link_never_receives_the_checkpoint(
    run: Path, outside: Outside, name: str
) -> None:
    (run / name).symlink_to(outside.folder)
    train(small_spec(run, *MORE), resume=True)
    assert read_state(run)["round"] == 3
    assert sorted(p.name for p in outside.folder.iterdir()) == ["inside.txt"]
    assert outside.unchanged()


@pytest.mark.parametrize(
    ("name", "link_to"),
    [
        ("samples.jsonl", "file"),
        ("metrics.jsonl", "file"),
        ("spec.yaml", "file"),
        ("tensorboard", "folder"),
        ("mlruns", "folder"),
        ("checkpoint/state.json", "file"),
        ("checkpoint/actor", "folder"),
    ],
)
def test_a_run_whose_files_are_links_is_not_resumed(
    run: Path, outside: Outside, name: str, link_to: str
) -> None:
    path = run / name
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.symlink_to(outside.file if link_to == "file" else outside.folder)
    with pytest.raises(UserError) as info:
        train(small_spec(run, *MORE), resume=True)
    assert f"{path} is a symbolic link" in one_line(info)
    assert outside.unchanged()


def test_the_checkpoint_folder_itself_as_a_link_is_not_resumed(run: Path, tmp_path: Path) -> None:
    away = tmp_path / "away"
    shutil.move(run / CHECKPOINT, away)
    (run / CHECKPOINT).symlink_to(away)
    before = sorted(p.name for p in away.iterdir())
    with pytest.raises(UserError, match="checkpoint is a symbolic link"):
        RunFolder(run, resume=True, overwrite=False).open()
    assert sorted(p.name for p in away.iterdir()) == before


# ---------------------------------------------------------------- overwrite
def test_overwrite_removes_links_never_their_targets(run: Path, outside: Outside) -> None:
    for name in ("metrics.jsonl", "samples.jsonl", "curves.png"):
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to(outside.file)
    shutil.rmtree(run / CHECKPOINT)
    (run / CHECKPOINT).symlink_to(outside.folder)
    (run / "tensorboard").symlink_to(outside.folder)
    (run / LOCK).unlink(missing_ok=True)
    (run / LOCK).symlink_to(outside.file)
    train(small_spec(run, *RUN), overwrite=True)
    assert not any(p.is_symlink() for p in run.rglob("*"))
    assert read_state(run)["round"] == 2
    assert outside.unchanged()


def test_reads_never_follow_a_link_to_a_pipe_or_device(tmp_path: Path) -> None:
    """A link or a pipe where a run folder holds a file is never read (it could stall or
    flood the reader): the run's records are then simply absent."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "spec.yaml")
    with pytest.raises(UserError, match=r"metrics\.jsonl: cannot read"):
        read_metrics(tmp_path)
    from ppokit.compare import read_history, read_run_spec

    assert read_history(tmp_path) == [] and read_run_spec(tmp_path) is None
