"""A checkpoint is checked for what it is, not for what it says about itself: a manifest
sealed again after a shard was deleted, shard headers that cover part of a tensor (or
overlap), a number of shard sets other than the processes state.json records, non-finite
weights, out-of-range state.json fields and deeply nested JSON or YAML are each one line
naming the tensor or the file, for resume, export and eval alike."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ppokit.cli import app
from ppokit.errors import UserError
from ppokit.runfolder import CHECKPOINT, MAX_DEPTH, check_metrics, load_json, read_metrics
from tests.helpers import one_error_line
from tests.helpers.trainer import one_line_error, reseal_manifest, run_fixtures, small_spec
from tests.helpers.trainer import resume as resume_run

RUN = ["train.rounds=2", "output.save_every=1"]
DEEP = 100_000


trained, run = run_fixtures(*RUN)


def resume(out: Path) -> int:
    return resume_run(out, *RUN)


def resume_error(out: Path) -> str:
    return one_line_error(resume, out)


def cli_error(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 1, result.output
    return one_error_line(result.stderr)


def for_every_load(run: Path, tmp_path: Path, fragment: str) -> None:
    """Resume, export and eval each refuse ``run`` with one line holding ``fragment``."""
    assert fragment in resume_error(run)
    assert fragment in cli_error("export", str(run), str(tmp_path / "exported"))
    assert not (tmp_path / "exported").exists()
    assert fragment in cli_error("eval", str(run))


def shard_files(ckpt: Path, folder: str) -> list[Path]:
    return sorted((ckpt / folder).glob("*.safetensors"))


def split_in_two(ckpt: Path, folders: tuple[str, ...] = ("actor", "critic", "optim")) -> None:
    """Rewrite a one-process checkpoint as two processes would have written it: each DCP
    folder's tensors split by rows into two shard files (offsets in their headers), a second
    process's RNG files, ``processes: 2``; the manifest sealed again."""
    for folder in folders:
        (file,) = shard_files(ckpt, folder)
        with safe_open(str(file), "pt") as fh:
            meta = fh.metadata()
        tensors = load_file(file)
        parts: list[dict[str, torch.Tensor]] = [{}, {}]
        infos: list[dict[str, Any]] = [{}, {}]
        for name, t in tensors.items():
            if t.dim() >= 1 and t.shape[0] >= 2:
                half = t.shape[0] // 2
                parts[0][name], parts[1][name] = t[:half].clone(), t[half:].clone()
                infos[0][name] = {"saved_offsets": [0] * t.dim()}
                infos[1][name] = {"saved_offsets": [half] + [0] * (t.dim() - 1)}
            else:
                parts[0][name] = t
                infos[0][name] = {"saved_offsets": [0] * t.dim()}
        file.unlink()
        for k in (0, 1):
            save_file(
                parts[k],
                str(ckpt / folder / f"shard-0000{k + 1}-model-00001-of-00001.safetensors"),
                metadata={**meta, "DCP_SHARDING_INFO": json.dumps(infos[k])},
            )
    for ext in ("json", "safetensors"):
        shutil.copy(ckpt / "rng" / f"process-00000.{ext}", ckpt / "rng" / f"process-00001.{ext}")
    edit_state(ckpt, processes=2)


def edit_state(ckpt: Path, **fields: Any) -> None:
    state = json.loads((ckpt / "state.json").read_text())
    state.update(fields)
    (ckpt / "state.json").write_text(json.dumps(state))
    reseal_manifest(ckpt)


def edit_header(file: Path, name: str, offsets: list[int]) -> None:
    with safe_open(str(file), "pt") as fh:
        meta = fh.metadata()
    info = json.loads(meta["DCP_SHARDING_INFO"])
    info[name] = {"saved_offsets": offsets}
    save_file(load_file(file), str(file), metadata={**meta, "DCP_SHARDING_INFO": json.dumps(info)})


# ---------------------------------------------------------------- shards
def test_a_checkpoint_of_two_processes_resumes(run: Path) -> None:
    """The two-shard rewrite itself is sound: its shards cover every tensor once."""
    split_in_two(run / CHECKPOINT)
    assert resume(run) == 2


def test_a_deleted_shard_with_a_resealed_manifest_is_refused(run: Path, tmp_path: Path) -> None:
    ckpt = run / CHECKPOINT
    split_in_two(ckpt)
    shard_files(ckpt, "actor")[1].unlink()
    reseal_manifest(ckpt)
    for_every_load(run, tmp_path, "actor/ holds 1 shard file(s) of 1 process(es) but state.json")


def test_a_deleted_shard_with_processes_rewritten_is_a_coverage_error(
    run: Path, tmp_path: Path
) -> None:
    ckpt = run / CHECKPOINT
    split_in_two(ckpt, ("actor",))
    first, second = shard_files(ckpt, "actor")
    first.unlink()  # the rows from 0: what is left claims the tensor's whole size
    second.rename(first)
    for ext in ("json", "safetensors"):
        (ckpt / "rng" / f"process-00001.{ext}").unlink()
    edit_state(ckpt, processes=1)
    for_every_load(
        run, tmp_path, "actor/ lm_head.weight: its shards cover 1632 of its 3232 elements"
    )


def test_shards_that_overlap_are_refused(run: Path) -> None:
    ckpt = run / CHECKPOINT
    split_in_two(ckpt)
    edit_header(shard_files(ckpt, "actor")[1], "lm_head.weight", [0, 0])
    reseal_manifest(ckpt)
    assert "actor/ lm_head.weight: two shards overlap" in resume_error(run)


@pytest.mark.parametrize("processes", [2, 0, 10**9, True, "1"])
def test_processes_must_match_the_shards(run: Path, processes: Any) -> None:
    edit_state(run / CHECKPOINT, processes=processes)
    assert "process" in resume_error(run)


# ---------------------------------------------------------------- non-finite weights
@pytest.mark.parametrize(("folder", "name"), [("actor", "model.norm.weight")])
def test_non_finite_weights_are_refused_by_every_load(
    run: Path, tmp_path: Path, folder: str, name: str
) -> None:
    (file,) = shard_files(run / CHECKPOINT, folder)
    with safe_open(str(file), "pt") as fh:
        meta = fh.metadata()
    tensors = load_file(file)
    tensors[name][0] = float("nan")
    save_file(tensors, str(file), metadata=meta)
    reseal_manifest(run / CHECKPOINT)
    for_every_load(run, tmp_path, f"{folder} {name} holds NaN or inf")


def test_a_non_finite_optimizer_state_is_refused_on_resume(run: Path) -> None:
    (file,) = shard_files(run / CHECKPOINT, "optim")
    with safe_open(str(file), "pt") as fh:
        meta = fh.metadata()
    tensors = load_file(file)
    name = next(k for k, t in tensors.items() if t.is_floating_point() and t.numel() > 1)
    tensors[name].view(-1)[0] = float("inf")
    save_file(tensors, str(file), metadata=meta)
    reseal_manifest(run / CHECKPOINT)
    assert "the optimizer's" in resume_error(run) and "NaN or inf" in resume_error(run)


# ---------------------------------------------------------------- state.json
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("round", 1e12),
        ("round", 10**12),
        ("round", -1),
        ("round", True),
        ("round", "3"),
        ("kl_coef", -0.5),
        ("kl_coef", None),
        ("critic", 3),
        ("lora_base", [1.0]),
    ],
)
def test_state_fields_have_types_and_ranges(
    run: Path, tmp_path: Path, field: str, value: Any
) -> None:
    edit_state(run / CHECKPOINT, **{field: value})
    started = time.monotonic()
    assert f"state.json: {field} is" in resume_error(run)
    assert f"state.json: {field} is" in cli_error("export", str(run), str(tmp_path / "e"))
    assert time.monotonic() - started < 30


def test_a_huge_round_allocates_nothing(run: Path) -> None:
    """The metrics check finds the gaps without building the range of rounds (10**12
    rounds would be terabytes as a set)."""
    started = time.monotonic()
    with pytest.raises(UserError, match=r"lacks round\(s\) 3-1000000000000|ends at round 2"):
        check_metrics(run / "metrics.jsonl", 10**12)
    assert time.monotonic() - started < 5


def test_a_resume_from_a_huge_round_is_one_line(run: Path) -> None:
    edit_state(run / CHECKPOINT, round=10**12)
    args = ["train", str(run / "spec.yaml"), "--out", str(run), "--resume"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "state.json: round is" in result.stderr


# ---------------------------------------------------------------- nesting
def deep_json() -> str:
    return "[" * DEEP + "]" * DEEP


def test_deep_json_is_a_value_error_not_a_recursion_error() -> None:
    with pytest.raises(ValueError, match="nested more than"):
        load_json(deep_json())
    with pytest.raises(ValueError, match="nested more than"):
        load_json("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    assert load_json("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None


@pytest.mark.parametrize("name", ["state.json", "manifest.json", "optim.json"])
def test_deeply_nested_checkpoint_json_is_one_line(run: Path, tmp_path: Path, name: str) -> None:
    ckpt = run / CHECKPOINT
    (ckpt / name).write_text(deep_json())
    if name != "manifest.json":
        reseal_manifest(ckpt)
    message = resume_error(run)
    assert "nested more than" in message or "unreadable" in message
    assert "Recursion" not in message
    if name != "optim.json":  # an export reads no optimizer state
        assert "nested more than" in cli_error("export", str(run), str(tmp_path / "e"))


def test_a_deeply_nested_run_spec_is_one_line(run: Path, tmp_path: Path) -> None:
    deep = "a: " + "[" * DEEP + "]" * DEEP + "\n"
    (run / "spec.yaml").write_text(deep)
    (run / CHECKPOINT / "spec.yaml").write_text(deep)
    reseal_manifest(run / CHECKPOINT)
    assert "spec.yaml" in cli_error("eval", str(run))
    assert "spec.yaml" in cli_error("export", str(run), str(tmp_path / "e"))
    args = ["train", str(tmp_path / "spec.yaml"), "--out", str(run), "--resume"]
    (tmp_path / "spec.yaml").write_text(small_spec(run, *RUN).to_yaml())
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "spec.yaml" in result.stderr


def test_a_deeply_nested_metrics_line_is_skipped(run: Path) -> None:
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write(deep_json() + "\n")
    assert [r["round"] for r in read_metrics(run)] == [1, 2]
