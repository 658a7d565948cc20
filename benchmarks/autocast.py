"""Benchmark of bfloat16 autocast against float32 for the trainer's passes on a CPU: which
model sizes gain, and on which matrix units (what ``model.dtype: auto`` picks on a CPU).

For each model shape (the demo's tiny model up to a SmolLM2-135M-shaped one, random weights,
Llama architecture) it times ppokit's own passes over B sequences of L tokens
(:mod:`ppokit.trainer.logprobs`: the trunk, then the chunked LM head and log-softmax in
float32): a no-grad forward (log π_old, the reference) and a forward + backward of
Σ log π + Σ entropy (the update's), each in float32 and under bfloat16 autocast, the two
interleaved, median of ``--repeats``. With ``--isa`` it reruns the whole table in a fresh
process per oneDNN instruction-set ceiling (``ONEDNN_MAX_CPU_ISA``: ``AVX512_CORE_AMX`` the
AMX tiles, ``AVX512_CORE_BF16`` bfloat16 vector instructions without AMX,
``AVX512_CORE`` no bfloat16 instructions, as on a CPU without them), so one machine with AMX
measures all three kinds of CPU.

    python benchmarks/autocast.py [--threads 1] [--repeats 3] [--isa AVX512_CORE_AMX,...]
                                  [--shapes tiny,w128,w256,w576l8,smollm2] [--tokens BxL]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from ppokit.trainer.logprobs import output_head, token_logprobs, trunk_hidden
from ppokit.trainer.models import Runtime, autocast

#: Model shapes (LlamaConfig fields): the demo's tiny model, three between, SmolLM2-135M's.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, vocab_size=101),
    "w128": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=2, num_key_value_heads=2, vocab_size=4096),
    "w256": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, vocab_size=8192),
    "w576l8": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                   tie_word_embeddings=True),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    tie_word_embeddings=True),
}  # fmt: skip
ISAS = ("AVX512_CORE_AMX", "AVX512_CORE_BF16", "AVX512_CORE")


def model_of(shape: dict[str, Any]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=1024, **shape)
    return LlamaForCausalLM(config).float()


def passes(model: torch.nn.Module, ids: torch.Tensor, amp: torch.dtype | None) -> dict[str, float]:
    """Seconds of a no-grad forward and of a forward + backward under ``amp`` (None: float32)."""
    runtime = Runtime(torch.device("cpu"), amp)
    attn = torch.ones_like(ids)
    targets = ids[:, 1:]

    def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
        with autocast(runtime):
            hidden = trunk_hidden(model.base_model, ids, attn)[:, :-1]
            return token_logprobs(hidden, output_head(model), targets)

    out = {}
    begin = time.perf_counter()
    with torch.no_grad():
        forward()
    out["forward"] = time.perf_counter() - begin
    begin = time.perf_counter()
    logp, ent = forward()
    assert ent is not None
    (logp.sum() + ent.sum()).backward()
    out["train"] = time.perf_counter() - begin
    model.zero_grad(set_to_none=True)
    return out


def table(shapes: list[str], tokens: tuple[int, int], repeats: int) -> None:
    b, length = tokens
    print(
        f"oneDNN ISA ceiling {os.environ.get('ONEDNN_MAX_CPU_ISA', 'none')}, "
        f"{torch.get_num_threads()} thread(s), {b} x {length} tokens, median of {repeats}"
    )
    print(
        f"{'shape':>8} {'params M':>9} {'fwd fp32 s':>11} {'fwd bf16 s':>11} {'fwd x':>6} "
        f"{'f+b fp32 s':>11} {'f+b bf16 s':>11} {'f+b x':>6}"
    )
    for name in shapes:
        shape = SHAPES[name]
        model = model_of(shape)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, shape["vocab_size"], (b, length), generator=g)
        passes(model, ids[:, :8], None)  # warm-up, both paths
        passes(model, ids[:, :8], torch.bfloat16)
        runs: dict[str, list[dict[str, float]]] = {"fp32": [], "bf16": []}
        for _ in range(repeats):
            runs["fp32"].append(passes(model, ids, None))
            runs["bf16"].append(passes(model, ids, torch.bfloat16))
        med = {k: {p: statistics.median(r[p] for r in v) for p in v[0]} for k, v in runs.items()}
        f32, b16 = med["fp32"], med["bf16"]
        print(
            f"{name:>8} {params:9.2f} {f32['forward']:11.3f} {b16['forward']:11.3f} "
            f"{f32['forward'] / b16['forward']:6.2f} {f32['train']:11.3f} {b16['train']:11.3f} "
            f"{f32['train'] / b16['train']:6.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="8x256", help="BxL: sequences x tokens")
    parser.add_argument("--isa", default=None, help=f"comma-separated, of {', '.join(ISAS)}")
    args = parser.parse_args()
    if args.isa:  # one fresh process per ceiling: oneDNN reads it once
        argv, skip = [], False
        for a in sys.argv[1:]:  # the same arguments without --isa
            if skip or a.startswith("--isa"):
                skip = a == "--isa" and not skip
                continue
            argv.append(a)
        for isa in args.isa.split(","):
            env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
            subprocess.run([sys.executable, __file__, *argv], env=env, check=True)
        return
    torch.set_num_threads(args.threads)
    b, length = (int(x) for x in args.tokens.lower().split("x"))
    print(f"torch {torch.__version__}, CPU capabilities: " + ", ".join(
        k for k in ("amx_bf16", "avx512_bf16") if torch.cpu.get_capabilities().get(k)
    ))  # fmt: skip
    table(args.shapes.split(","), (b, length), args.repeats)


if __name__ == "__main__":
    main()
