"""Small specs and learners on the tiny model for the trainer tests."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from ppokit.spec import Spec, load_spec
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.models import build_models
from ppokit.trainer.rollout import Rollout
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
    # the resume tests lengthen a run; a schedule over the run's rounds would then change
    "train.lr_schedule=constant",
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


def with_observations(ro: Rollout) -> Rollout:
    """``ro`` as a multi-turn rollout: positions 1, 4, 7, ... inside each response (never
    its first or last token) become the environment's tokens (``env_mask``, out of the
    response mask, log μ 0), as observations between the model's turns."""
    mask = ro.response_mask
    t = torch.arange(mask.shape[1])
    last = mask.sum(1, keepdim=True) - 1
    env = mask & (t % 3 == 1) & (t < last)
    model = mask & ~env
    logp = None if ro.logp_rollout is None else ro.logp_rollout * model
    b = mask.shape[0]
    return Rollout(
        ro.prompt_ids,
        ro.prompt_mask,
        ro.response_ids,
        model,
        ro.truncated,
        logp,
        env_mask=env,
        turn_rewards=torch.zeros(mask.shape),
        turns=1 + env.sum(1),
        ended=torch.zeros(b, dtype=torch.long),
    )


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


def run_fixtures(*overrides: str, symlinks: bool = False, after: Any = None) -> tuple[Any, Any]:
    """The ``trained`` (a run of ``small_spec(out, *overrides)``, trained once for the test
    module) and ``run`` (a fresh copy of it for each test; ``symlinks``: links copied as
    links; ``after(out)``: applied to the copy) fixtures: ``trained, run = run_fixtures(...)``
    at a test module's top level."""
    import shutil

    import pytest

    from ppokit.trainer import train

    @pytest.fixture(scope="module", name="trained")
    def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
        out = tmp_path_factory.mktemp("trained") / "run"
        train(small_spec(out, *overrides))
        return out

    @pytest.fixture(name="run")
    def run(trained: Path, tmp_path: Path) -> Path:
        out = tmp_path / "run"
        shutil.copytree(trained, out, symlinks=symlinks)
        if after is not None:
            after(out)
        return out

    return trained, run


def resume(out: Path, *overrides: str) -> int:
    """``load_checkpoint`` of ``out`` into a fresh learner of ``small_spec(out, *overrides)``:
    the round it resumes at."""
    from ppokit.data import make_prompt_source
    from ppokit.trainer.checkpoint import load_checkpoint

    spec = small_spec(out, *overrides)
    return load_checkpoint(out, learner(spec), make_prompt_source(spec.data, spec.seed))


def one_line_error(fn: Any, *args: Any) -> str:
    """The message of the ``UserError`` that ``fn(*args)`` raises: one line, not empty."""
    import pytest

    from ppokit.errors import UserError

    with pytest.raises(UserError) as info:
        fn(*args)
    message = str(info.value)
    assert message and "\n" not in message
    return message
