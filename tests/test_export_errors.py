"""``ppokit export`` answers every user-caused problem with one line and a non-zero status:
crafted shard headers (as ``--resume`` does), output paths that are links (dangling or not)
and output folders whose parent cannot be written. Nothing is written through a link."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ppokit.cli import app
from ppokit.runfolder import CHECKPOINT
from tests.helpers.trainer import reseal_manifest, run_fixtures
from tests.trainer.checkpoint.test_safety import (  # the crafted headers resume refuses
    _dtype,
    _edit_header,
    _offsets,
    _sharding_info,
)

SHARD = "shard-00001-model-00001-of-00001.safetensors"


trained, run = run_fixtures("train.rounds=1", "output.save_every=1")


def export_error(*args: str) -> str:
    result = CliRunner().invoke(app, ["export", *args])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "edit",
    [
        _offsets([10**12, 0]),
        _offsets([-5, 0]),
        _offsets([0]),
        _sharding_info("{nope"),
        _sharding_info("{}"),
        _dtype,
    ],
    ids=["huge offset", "negative offset", "offsets too short", "not JSON", "no info", "dtype"],
)
def test_a_crafted_shard_header_is_one_line(run: Path, tmp_path: Path, edit: Any) -> None:
    _edit_header(run / CHECKPOINT / "actor" / SHARD, edit)
    reseal_manifest(run / CHECKPOINT)
    assert "checkpoint" in export_error(str(run), str(tmp_path / "exported"))
    assert not (tmp_path / "exported").exists()


def test_an_output_that_is_a_link_is_refused(run: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "out").symlink_to(target)
    assert "is a symbolic link" in export_error(str(run), str(tmp_path / "out"))
    assert list(target.iterdir()) == []


def test_a_dangling_link_is_refused(run: Path, tmp_path: Path) -> None:
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    assert "is a symbolic link" in export_error(str(run), str(tmp_path / "out"))
    assert not (tmp_path / "nowhere").exists()


def test_a_parent_that_cannot_be_written_is_one_line(run: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    line = export_error(str(run), str(tmp_path / "file" / "out"))
    assert "not a directory" in line and "file" in line


def test_a_stale_temporary_link_is_removed_not_followed(run: Path, tmp_path: Path) -> None:
    """A link left at the export's temporary name is removed, never written through."""
    import os

    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / f".out.export-{os.getpid()}").symlink_to(target)
    result = CliRunner().invoke(app, ["export", str(run), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert list(target.iterdir()) == []
    assert (tmp_path / "out" / "config.json").is_file()
