"""What ``ppokit train --nproc N`` says after a process was killed: the last checkpoint and
the command that resumes (a run folder without one: the command that starts again)."""

from __future__ import annotations

from pathlib import Path

from ppokit.launcher import how_to_continue


def test_a_folder_without_a_checkpoint_starts_again(tmp_path: Path) -> None:
    lines = how_to_continue(tmp_path, ["ppokit", "train", "--nproc", "2"])
    assert lines[0] == f"no checkpoint was written yet in {tmp_path}"
    assert lines[1].endswith(f"--nproc 2 --out {tmp_path} --overwrite")
