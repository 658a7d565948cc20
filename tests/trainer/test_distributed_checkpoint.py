"""Sharded checkpoints (gloo, 2 CPU processes): every process writes its own shards through
torch.distributed.checkpoint, and the checkpoint reads back exactly on 2 processes, on 1
process, and the other way (written by 1, read by 2).

After one update on the injected round of ``test_distributed`` (so the optimizer has
states), the whole weights and optimizer states are taken as the reference; a fresh learner
that loads the checkpoint must hold them bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ppokit import distributed
from ppokit.data import make_prompt_source
from ppokit.spec import Spec
from ppokit.trainer.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from tests.helpers import built_once, free_port
from tests.helpers.ranks import as_process, run_two
from tests.helpers.trainer import learner

from .test_distributed import CONFIGS, SCORES, _own, _rollout, _spec

#: A separate critic with micro-batches, a shared critic with a clipped grad norm, and LoRA
#: (the adapters alone are stored; the base weights' sums are checked on every process).
CASES = {
    "separate": CONFIGS["token_mean, separate critic, gae, micro-batches"],
    "shared": CONFIGS["seq_mean_token_sum_norm, shared critic, clipped grad norm"],
    "lora": CONFIGS["token_mean, LoRA, reference = adapters off"],
}


def _learner(spec: Spec) -> Any:
    lrn = learner(spec)
    if distributed.world().distributed:
        lrn.reshard()  # optimizers over the shards
    return lrn


def _updated(spec: Spec) -> Any:
    """A learner after one update on the injected round (this process's rows)."""
    world = distributed.world()
    rows, ro = _rollout(spec)
    lrn = _learner(spec)
    share = world.share(len(rows))
    scores = torch.tensor(SCORES)[world.share(len(SCORES))]
    torch.manual_seed(7)
    mine = _own(ro, world.rank, world.size)
    lrn.round(rows[share], [r["prompt"] for r in rows[share]], 1, rollout=mine, scores=scores)
    return lrn


def _whole(lrn: Any) -> dict[str, torch.Tensor]:
    """Every weight and optimizer state, whole (a collective on several processes)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    out: dict[str, torch.Tensor] = {}
    modules = [("actor", lrn.setup.models.actor, lrn.state.optimizers.actor)]
    if lrn.setup.models.critic is not None:
        modules.append(("critic", lrn.setup.models.critic, lrn.state.optimizers.critic))
    for label, module, opt in modules:
        for name, p in module.named_parameters():
            out[f"{label}.{name}"] = distributed.full_tensor(p.detach()).clone()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(module, opt, options=options)
        for param, values in state.get("state", {}).items():  # only process 0 gets them
            for key, value in values.items():
                out[f"{label}.optim.{param}.{key}"] = value.detach().clone()
    return out


def _worker(rank: int, port: int, folder: str) -> None:
    as_process(rank, port)
    with distributed.process_group("cpu", 120):
        for case, overrides in CASES.items():
            spec = _spec(overrides)
            run = Path(folder) / f"two-{case}"
            lrn = _updated(spec)
            save_checkpoint(
                run,
                lrn.setup.models,
                lrn.state,
                make_prompt_source(spec.data, spec.seed),
                1,
                "{}\n",
            )
            saved = _whole(lrn)
            fresh = _learner(spec)
            assert (
                load_checkpoint(
                    run, fresh.setup.models, fresh.state, make_prompt_source(spec.data, spec.seed)
                )
                == 1
            )
            again = _whole(fresh)
            other = _learner(spec)  # the checkpoint one process wrote
            one = Path(folder) / f"one-{case}"
            assert (
                load_checkpoint(
                    one, other.setup.models, other.state, make_prompt_source(spec.data, spec.seed)
                )
                == 1
            )
            from_one = _whole(other)
            if rank == 0:
                save_file(saved, f"{folder}/{case}-saved.safetensors")
                save_file(again, f"{folder}/{case}-two-to-two.safetensors")
                save_file(from_one, f"{folder}/{case}-one-to-two.safetensors")


def _write_checkpoints(folder: Path) -> None:
    for case, overrides in CASES.items():  # one process writes its checkpoints first
        spec = _spec(overrides)
        lrn = _updated(spec)
        run = folder / f"one-{case}"
        save_checkpoint(
            run, lrn.setup.models, lrn.state, make_prompt_source(spec.data, spec.seed), 1, "{}\n"
        )
        save_file(_whole(lrn), f"{folder}/{case}-one.safetensors")
    run_two(_worker, free_port(), str(folder))  # then two processes write theirs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built_once(tmp_path_factory, "distributed-checkpoints", _write_checkpoints)


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_process_writes_its_own_shards(checkpoints: Path, case: str) -> None:
    ckpt = checkpoints / f"two-{case}" / CHECKPOINT
    saved = load_file(checkpoints / f"{case}-saved.safetensors")
    for folder in ("actor", "optim"):
        files = sorted((ckpt / folder).glob("*.safetensors"))
        assert len(files) == 2, files  # one per process, nothing gathered on one
    parts = [load_file(f) for f in sorted((ckpt / "actor").glob("*.safetensors"))]
    name = "model.layers.0.mlp.gate_proj.weight"
    if case == "lora":
        name = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.default.weight"
        assert all("lora_" in k for part in parts for k in part)  # no base weight
    whole = saved[f"actor.{name}"]
    assert [p[name].shape[0] for p in parts] == [whole.shape[0] // 2] * 2
    assert torch.equal(torch.cat([p[name] for p in parts]), whole)
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == [
        f"process-0000{r}.{ext}" for r in (0, 1) for ext in ("json", "safetensors")
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_processes_read_back_exactly(checkpoints: Path, case: str) -> None:
    saved = load_file(checkpoints / f"{case}-saved.safetensors")
    _assert_equal(load_file(checkpoints / f"{case}-two-to-two.safetensors"), saved)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_process_reads_two_processes_checkpoint(checkpoints: Path, case: str) -> None:
    spec = _spec(CASES[case])
    fresh = learner(spec)
    run = checkpoints / f"two-{case}"
    assert (
        load_checkpoint(
            run, fresh.setup.models, fresh.state, make_prompt_source(spec.data, spec.seed)
        )
        == 1
    )
    _assert_equal(_whole(fresh), load_file(checkpoints / f"{case}-saved.safetensors"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_processes_read_one_process_checkpoint(checkpoints: Path, case: str) -> None:
    one = load_file(checkpoints / f"{case}-one.safetensors")
    _assert_equal(load_file(checkpoints / f"{case}-one-to-two.safetensors"), one)
