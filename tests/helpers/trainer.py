"""Small specs and learners on the tiny model for the trainer tests."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from ppokit.spec import Spec, load_spec
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.models import build_models
from ppokit.trainer.round import Learner

DEMO = Path(__file__).resolve().parents[2] / "ppokit" / "specs" / "demo.yaml"

#: A small, fast version of the demo spec.
SMALL = [
    "output.progress=false",
    "train.rounds=1",
    "rollout.prompts_per_round=4",
    "rollout.n=2",
    "rollout.max_new_tokens=4",
    "train.minibatch_size=null",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
]


def small_spec(tmp: Path | None = None, *overrides: str) -> Spec:
    out = [f"output.dir={tmp}"] if tmp is not None else []
    return load_spec(DEMO, [*SMALL, *out, *overrides])


def learner(spec: Spec) -> Learner:
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    assembly = Assembly.from_spec(spec)
    return Learner(spec, build_models(spec, assembly.head_size), assembly)


def encode(lrn: Learner, prompts: list[str], n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's left-padded prompt ids and mask, each prompt ``n`` times."""
    ids, attn = lrn.encode(prompts, lrn.spec.data, lrn.spec.rollout.max_new_tokens)
    return ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)


def demo_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    from ppokit.tasks.demo import make_row

    rng = random.Random(seed)
    return [make_row(rng) for _ in range(n)]


def reseal_manifest(folder: Path) -> None:
    """Make a checkpoint's manifest match its files again (as someone who edited the files
    and rewrote the manifest would): the manifest proves nothing about who wrote them."""
    import hashlib
    import json

    manifest = json.loads((folder / "manifest.json").read_text())
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest["files"] = {
        p.relative_to(folder).as_posix(): {
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "bytes": p.stat().st_size,
        }
        for p in files
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
