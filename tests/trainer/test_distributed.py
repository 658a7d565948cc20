"""Several processes (gloo, 2 CPU processes) optimise exactly the single-process objective.

One update on a fixed round: the rollout and its rewards are injected, the same on one
process holding every row and on two processes holding half the rows each (the second
half's responses shorter, so the processes' batches are padded differently). The
parameters after the optimizer step and every logged metric agree within 1e-5 (relative),
for the four aggregations, with and without a critic (separate and shared), with
micro-batches (of a number of rows, or of a token budget, padded or packed, which every
process runs as many of), with a KL term in the loss, with LoRA (the reference: adapters off) and for
estimators that whiten over the batch (gae, reinforce_pp) or over groups (grpo, rloo), and
gdpo, which reads each reward's scores (the gathered [B, K] fields). A
loss scaled by the number of processes (or its square) changes the logged loss and gradient
norm, so such a bug fails here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ppokit import distributed
from ppokit.cli import app
from ppokit.export import export_run
from ppokit.spec import Spec
from ppokit.trainer.metrics import TIMING, read_once
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.scoring import Scores
from tests.helpers.ranks import as_process, train_on_two, written_by_two
from tests.helpers.trainer import demo_rows, encode, learner, small_spec, with_observations

PROMPTS, N, T = 4, 2, 6
#: Response lengths: the first process's rows are longer than the second's.
LENGTHS = [6, 3, 5, 2, 1, 4, 2, 3]
SCORES = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25]
#: Two rewards' scores (weights 1 and 0.5) whose weighted sum is SCORES, for gdpo.
PARTS = {"correct": [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0], "format": [0, 0, 1, 0, 0, 0, 0, 0.5]}
WEIGHTS = {"correct": 1.0, "format": 0.5}

BASE = [
    f"rollout.prompts_per_round={PROMPTS}",
    f"rollout.n={N}",
    f"rollout.max_new_tokens={T}",
    "train.ppo_epochs=2",
    "train.max_grad_norm=null",
]
CONFIGS: dict[str, list[str]] = {
    "token_mean, separate critic, gae, micro-batches": [
        "policy.aggregation=token_mean",
        "train.micro_batch_size=2",
    ],
    "seq_mean_token_mean, grpo, no critic": [
        "policy.aggregation=seq_mean_token_mean",
        "advantage=grpo",
        "critic=null",
    ],
    "seq_mean_token_sum, reinforce_pp, kl in the loss": [
        "policy.aggregation=seq_mean_token_sum",
        "advantage=reinforce_pp",
        "critic=null",
        "kl.estimator=k3",
        "kl.coef=0.1",
        "kl.placement=loss",
        "train.micro_batch_size=1",
    ],
    "token_mean, LoRA, reference = adapters off": [
        "model.lora={r: 4, alpha: 8, target_modules: all-linear}",
        "advantage=rloo",
        "critic=null",
        "kl.estimator=k3",
        "kl.coef=0.1",
        "kl.placement=loss",
    ],
    "token_mean, token_tis on π_old's forward, micro-batches": [
        "policy.correction={name: token_tis, cap: 1.03}",
        "rollout.logp_old=forward",
        "train.micro_batch_size=4",
    ],
    "token_mean, staleness 1: decoupled token_tis, micro-batches": [
        "rollout.max_staleness=1",
        "policy.correction={name: token_tis, cap: 1.03}",
        "train.micro_batch_size=2",
    ],
    "seq_mean_token_mean, geo_mask rejects rows": [
        "policy.aggregation=seq_mean_token_mean",
        "policy.correction={name: geo_mask, low: 0.99, high: 1.01}",
        "rollout.logp_old=forward",
        "advantage=grpo",
        "critic=null",
    ],
    "seq_mean_token_mean, multi-turn (environment tokens), gae, micro-batches": [
        "policy.aggregation=seq_mean_token_mean",
        "rollout.environment=echo",
        "reward=[]",
        "train.micro_batch_size=2",
    ],
    "seq_mean_token_mean, gdpo over two rewards (batch-normalised)": [
        "policy.aggregation=seq_mean_token_mean",
        "advantage=gdpo",
        "critic=null",
    ],
    "token_mean, separate critic, micro-batches of 16 tokens, packed": [
        "policy.aggregation=token_mean",
        "train.micro_batch_tokens=16",
        "train.pack_sequences=true",
    ],
    "seq_mean_token_mean, multi-turn, kl in the loss, micro-batches of 20 tokens": [
        "policy.aggregation=seq_mean_token_mean",
        "rollout.environment=echo",
        "reward=[]",
        "kl.estimator=k3",
        "kl.coef=0.1",
        "kl.placement=loss",
        "train.micro_batch_tokens=20",
    ],
    "seq_mean_token_sum_norm, shared critic, clipped grad norm": [
        "policy.aggregation=seq_mean_token_sum_norm",
        "model.critic=shared",
        "train.max_grad_norm=0.05",
        "train.micro_batch_size=2",
    ],
}


def _spec(overrides: list[str]) -> Spec:
    return small_spec(None, *BASE, *overrides)


def _rollout(spec: Spec) -> tuple[list[dict[str, Any]], Rollout]:
    """A fixed round: the demo's prompts, random response tokens with LENGTHS, and the
    behaviour log-probs of the untrained actor."""
    rows = demo_rows(PROMPTS)
    lrn = learner(spec)
    formatted = [row["prompt"] for row in rows]
    ids, attn = encode(lrn, formatted, N)
    g = torch.Generator().manual_seed(1)
    vocab = lrn.setup.models.actor.config.vocab_size
    response = torch.randint(3, vocab, (PROMPTS * N, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    truncated = torch.tensor(LENGTHS) == T
    ro = Rollout(ids, attn, response, mask, truncated, None)
    with torch.no_grad():
        logp, _, _ = lrn.setup.forwards.actor(lrn.setup.models.actor, ro)
    # an engine whose μ is off π_old by a little, as another kernel or dtype makes it
    mismatch = 0.05 * torch.randn(logp.shape, generator=g)
    ro.logp_rollout = (logp + mismatch) * mask
    if spec.rollout.environment.name != "none":
        ro = with_observations(ro)
    return rows, ro


def _own(ro: Rollout, rank: int, size: int) -> Rollout:
    """The rows of one process, cut to their own longest response."""
    each = ro.response_ids.shape[0] // size
    part = ro.rows(torch.arange(rank * each, (rank + 1) * each))
    length = int(part.present.sum(1).max())
    for name in ("response_ids", "response_mask", "logp_rollout", "env_mask", "turn_rewards"):
        x = getattr(part, name)
        setattr(part, name, None if x is None else x[:, :length])
    return part


def _one_update(spec: Spec, rows: list[dict[str, Any]], ro: Rollout) -> tuple[Any, Any]:
    """(whole parameters, metrics) after collect + update of the injected round."""
    world = distributed.world()
    lrn = learner(spec)
    if world.distributed:
        lrn.reshard()  # optimizers over the shards
    share = world.share(len(rows))
    mine = _own(ro, world.rank, world.size)
    own = world.share(len(SCORES))
    scores: Any = torch.tensor(SCORES)[own]
    if spec.advantage.name == "gdpo":  # each reward's scores apart
        parts = {k: torch.tensor(v, dtype=torch.float32)[own] for k, v in PARTS.items()}
        scores = Scores(scores, parts, dict(WEIGHTS))
    formatted = [row["prompt"] for row in rows[share]]
    torch.manual_seed(7)  # the minibatch order
    result = lrn.round(rows[share], formatted, 1, rollout=mine, scores=scores)
    metrics = {k: v for k, v in read_once(result.metrics).items() if k not in TIMING}
    params = {}
    modules = [("actor", lrn.setup.models.actor), ("critic", lrn.setup.models.critic)]
    for label, module in modules:
        if module is None:
            continue
        for name, p in module.named_parameters():
            params[f"{label}.{name}"] = distributed.full_tensor(p.detach()).clone()
    return params, metrics


def _worker(rank: int, port: int, folder: str) -> None:
    as_process(rank, port)
    with distributed.process_group("cpu", 120):
        for i, overrides in enumerate(CONFIGS.values()):
            spec = _spec(overrides)
            rows, ro = _rollout(spec)
            params, metrics = _one_update(spec, rows, ro)
            if rank == 0:
                save_file(params, f"{folder}/params{i}.safetensors")
                Path(f"{folder}/metrics{i}.json").write_text(json.dumps(metrics))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return written_by_two(tmp_path_factory, "distributed-updates", _worker)


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=list(CONFIGS))
def test_two_processes_update_like_one(two_processes: Path, index: int) -> None:
    """Parameters within 1e-5 (relative, per tensor), the update itself (parameters minus
    their initial values) within 1e-4 (Adam divides by the root of the squared gradient,
    which magnifies roundings where a gradient is near 0), every metric within 1e-5."""
    spec = _spec(list(CONFIGS.values())[index])
    rows, ro = _rollout(spec)
    initial = {
        f"actor.{n}": p.detach().clone()
        for n, p in learner(spec).setup.models.actor.named_parameters()
        if p.requires_grad  # with LoRA: the adapters
    }
    params, metrics = _one_update(spec, rows, ro)
    theirs = load_file(two_processes / f"params{index}.safetensors")
    assert set(theirs) == set(params)
    for name, value in params.items():
        assert _relative(theirs[name], value) < 1e-5, name
    assert any(not torch.equal(params[n], start) for n, start in initial.items())  # it moved
    for name, start in initial.items():
        assert _relative(theirs[name] - start, params[name] - start) < 1e-4, name
    other = json.loads((two_processes / f"metrics{index}.json").read_text())
    assert set(other) == set(metrics)
    assert metrics["grad_norm_actor"] is not None and metrics["policy_loss"] is not None
    different = {k: (metrics[k], other[k]) for k in metrics if not _close(metrics[k], other[k])}
    assert not different
    if spec.rollout.logp_old == "forward" or spec.rollout.max_staleness:  # π_old recomputed
        assert metrics["rollout/mismatch_max"] > 0.01
    if spec.policy.correction.name != "none":  # the correction acts on this round
        assert metrics["rollout/correction_weight_mean"] != 1.0
        if spec.policy.correction.name == "geo_mask":
            assert 0 < metrics["rollout/correction_masked_rows"] < 1


def test_shares_and_seeds() -> None:
    world = distributed.World(rank=1, size=2)
    assert world.share(8) == slice(4, 8) and not world.main
    seeds = {distributed.round_seed(0, r, k) for r in range(2) for k in range(1, 4)}
    assert len(seeds) == 6  # per process and round
    assert distributed.round_seed(0, 1, 2) == distributed.round_seed(0, 1, 2)


# ------------------------------------------------------------- end to end (CLI)
SMALL_RUN = [
    "--set",
    "train.lr_schedule=constant",  # the run is lengthened on resume
    "--set",
    "rollout.prompts_per_round=4",
    "--set",
    "rollout.n=2",
    "--set",
    "rollout.max_new_tokens=4",
    "--set",
    "train.minibatch_size=null",
    "--set",
    "output.save_every=1",
    "--set",
    "output.progress=false",
]


def _ppokit(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ppokit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.mark.slow
def test_demo_on_two_processes_resumes_on_two_and_on_one(tmp_path: Path) -> None:
    """2 rounds on 2 processes (each setup line shown once), resumed for a third on 2 (the
    same metrics as 3 rounds without stopping) and a fourth on 1; the checkpoint exports and
    generates."""
    run = tmp_path / "run"
    first = _ppokit(
        "train", "--nproc", "2", "--out", str(run), "--set", "train.rounds=2", *SMALL_RUN
    )
    assert first.returncode == 0, first.stderr[-3000:]
    shown = first.stdout + first.stderr
    assert "2 processes" in shown
    setup = [line for line in shown.splitlines() if line.startswith("ppokit: ")]
    assert "ppokit: building the tiny model" in setup and any("CPU thread" in x for x in setup)
    assert len(setup) == len(set(setup)), shown  # the first process shows them, once
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]  # one process writes
    # resumed on 2 processes forked from the forkserver (the launcher's part, above, is the
    # same for a new run and a resumed one; its resume hint: test_killed_worker.py)
    train_on_two("train", "--out", str(run), "--resume", "--set", "train.rounds=3", *SMALL_RUN)
    straight = tmp_path / "straight"  # the same 3 rounds without stopping
    train_on_two("train", "--out", str(straight), "--set", "train.rounds=3", *SMALL_RUN)

    def untimed(folder: Path) -> list[dict[str, Any]]:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in lines]

    assert untimed(run) == untimed(straight)  # the resumed run continued exactly
    # on one process: the same command in this process (no interpreter of its own to start)
    single = CliRunner().invoke(
        app, ["train", "--out", str(run), "--resume", "--set", "train.rounds=4", *SMALL_RUN]
    )
    assert single.exit_code == 0, single.output[-3000:]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    assert all(r["reward_mean"] is not None for r in records)
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    assert state["round"] == 4
    # the checkpoint of a 2-process run exports like any other (the command: tests/test_export.py)
    exported = tmp_path / "hf"
    export_run(run, exported)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported)
    prompt = tokenizer(["ab"], return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert 1 <= out.shape[1] - prompt["input_ids"].shape[1] <= 3  # it generated


@pytest.mark.slow
def test_asynchronous_rollouts_on_two_processes(tmp_path: Path) -> None:
    """``rollout.max_staleness: 1`` on 2 processes: each process's hf engine samples from a
    whole copy gathered from the sharded actor, pushed (gathered again) between its
    generations; every round's staleness is the whole round's."""
    run = tmp_path / "run"
    train_on_two(
        "train", "--out", str(run), "--set", "train.rounds=3",
        "--set", "rollout.max_staleness=1", "--set", "policy.correction=token_tis", *SMALL_RUN,
    )  # fmt: skip
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert records[0]["rollout/mismatch_max"] < 1e-4  # round 1: the initial weights on both
    assert all(r["rollout/mismatch_max"] > 1e-3 for r in records[1:])  # one update behind


@pytest.mark.slow
def test_one_failing_process_ends_every_process(tmp_path: Path) -> None:
    """One process raises (its prompt does not fit the model's context): the run ends on
    every process with that error shown once and a non-zero exit, in bounded time."""
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "ab"}, {"prompt": "ab" * 400}]  # 800 tokens > the context of 512
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    start = time.perf_counter()
    done = _ppokit(
        "train",
        "--nproc",
        "2",
        "--out",
        str(tmp_path / "run"),
        "--set",
        f"data.source={data}",
        "--set",
        "data.shuffle=false",
        "--set",
        "reward=length_penalty",
        "--set",
        "train.rounds=2",
        *SMALL_RUN,
        "--set",
        "rollout.prompts_per_round=2",
        timeout=240,
    )
    elapsed = time.perf_counter() - start
    assert done.returncode != 0
    assert done.stderr.count("does not fit the model's context") == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert elapsed < 200
