"""The batches a checkpoint saves ahead of its round (asynchronous rollouts) read back as
written, and anything malformed in them is one line naming the file, never a traceback or
a batch trained on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ppokit.errors import UserError
from ppokit.trainer.checkpoint.ahead import Ahead, ahead_stem, read_ahead, write_ahead
from ppokit.trainer.rollout import Rollout

N, VOCAB = 2, 50


def _rollout(rows: int, version: int, logp: bool = True) -> Rollout:
    g = torch.Generator().manual_seed(rows)
    mask = torch.rand(rows, 5, generator=g) > 0.3
    return Rollout(
        prompt_ids=torch.randint(0, VOCAB, (rows, 3), generator=g),
        prompt_mask=torch.ones(rows, 3, dtype=torch.long),
        response_ids=torch.randint(0, VOCAB, (rows, 5), generator=g),
        response_mask=mask,
        truncated=torch.zeros(rows, dtype=torch.bool),
        logp_rollout=-torch.rand(rows, 5, generator=g) * mask if logp else None,
        version=torch.full((rows,), version, dtype=torch.long),
    )


def _batches() -> list[Ahead]:
    rows = [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": None}]
    return [
        Ahead(5, 2, rows, ["A", "B"], _rollout(2 * N, 2), _rollout(2, 2, logp=False)),
        Ahead(6, 3, rows[:1], ["A"], _rollout(N, 3)),
    ]


def _saved(tmp_path: Path) -> Path:
    (tmp_path / "ahead").mkdir()
    write_ahead(tmp_path / ahead_stem(0), _batches())
    return tmp_path


def _read(path: Path, processes: int = 1) -> list[Ahead]:
    return read_ahead(path, 0, processes, 4, N, VOCAB, torch.device("cpu"))


def test_the_batches_read_back_as_written(tmp_path: Path) -> None:
    got = _read(_saved(tmp_path))
    for a, b in zip(got, _batches(), strict=True):
        assert (a.round, a.version, a.rows, a.formatted) == (
            b.round,
            b.version,
            b.rows,
            b.formatted,
        )
        for x, y in ((a.rollout, b.rollout), (a.greedy, b.greedy)):
            if y is None:
                assert x is None
                continue
            assert x is not None
            for name in ("prompt_ids", "response_ids", "response_mask", "logp_rollout", "version"):
                left, right = getattr(x, name), getattr(y, name)
                assert (left is None and right is None) or torch.equal(left, right)
    assert read_ahead(tmp_path / "none", 0, 1, 4, N, VOCAB, torch.device("cpu")) == []


def _tampered(tmp_path: Path, name: str, value: torch.Tensor | None) -> Path:
    path = _saved(tmp_path)
    file = path / f"{ahead_stem(0)}.safetensors"
    tensors = load_file(str(file))
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, str(file))
    return path


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("0.response_ids", torch.full((4, 5), VOCAB), "ids outside the vocabulary of 50"),
        ("0.logp_rollout", torch.full((4, 5), float("nan")), "logp_rollout holds NaN or inf"),
        ("0.response_mask", torch.ones(4, 5, dtype=torch.long), "response_mask is torch.int64"),
        ("1.truncated", torch.zeros(3, dtype=torch.bool), "truncated has shape [3], not [2]"),
        ("1.version", torch.full((2,), 2), "its rows' versions are not the batch's (3)"),
        ("1.prompt_ids", None, "prompt_ids is missing"),
        ("7.stray", torch.zeros(1), "unknown tensor '7.stray'"),
    ],
)
def test_a_malformed_tensor_is_one_line(tmp_path, name: str, value, why: str) -> None:
    path = _tampered(tmp_path, name, value)
    with pytest.raises(UserError) as err:
        _read(path)
    assert why in str(err.value) and "ahead/process-00000" in str(err.value)
    assert "\n" not in str(err.value)


def test_batches_of_other_rounds_or_processes_are_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with pytest.raises(UserError, match="batch 0 is for round 5, not 4"):
        read_ahead(path, 0, 1, 3, N, VOCAB, torch.device("cpu"))
    rows = [{"prompt": "a"}]
    write_ahead(path / ahead_stem(0), [Ahead(6, 5, rows, ["A"], _rollout(N, 5))])
    with pytest.raises(UserError, match="version 5 is not older than the weights"):
        read_ahead(path, 0, 1, 5, N, VOCAB, torch.device("cpu"))
    with pytest.raises(UserError, match="not of this run's 2: resume on as many processes"):
        _read(path, processes=2)
