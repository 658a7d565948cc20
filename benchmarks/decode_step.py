"""What one decoding step of ``model.generate`` costs on a CPU, by the rows still decoding.

The ``hf`` engine decodes a round's responses with ``model.generate``: one forward pass of
one token per row per step, for as many steps as the longest response, the rows that have
ended included (they decode padding). This measures one such step of a SmolLM2-135M-shaped
model (random weights, shaped by SmolLM2's config; the speed depends on the shapes only),
with a KV cache of ``--context`` tokens, on one thread, for each row count, in three
precisions: float32, float32 weights under bfloat16 autocast (the ``hf`` engine beside a
bfloat16 trainer), and bfloat16 weights (what a bfloat16 copy of the actor would decode
with). Each figure is the median of ``--steps`` steps; the precisions are measured one after
the other on the same machine.

    python benchmarks/decode_step.py [--rows 16,8,4,2,1] [--context 150] [--steps 12]

Read: the cost of a step at 1 row is the floor that no batching or row dropping removes
(per-layer dispatch and the weights read once a step); the difference between 16 rows and
the rows a round still has decoding is what dropping ended rows could save.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

#: SmolLM2-135M's shapes (its GGUF file's config).
SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def step_ms(model: LlamaForCausalLM, rows: int, context: int, steps: int, autocast: bool) -> float:
    """Median milliseconds of one decoding step of ``rows`` rows after ``context`` tokens."""
    ids = torch.randint(0, SMOLLM2["vocab_size"], (rows, context))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        cache = model(ids, use_cache=True).past_key_values
        token = torch.randint(0, SMOLLM2["vocab_size"], (rows, 1))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16,8,4,2,1")
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).eval()
    rows = [int(r) for r in args.rows.split(",")]
    kinds = {"float32": (model, False), "bf16 autocast": (model, True)}
    table = {
        name: [step_ms(m, r, args.context, args.steps, a) for r in rows]
        for name, (m, a) in kinds.items()
    }
    half = model.to(torch.bfloat16)
    table["bf16 weights"] = [step_ms(half, r, args.context, args.steps, False) for r in rows]
    print(
        f"one decoding step, ms (median of {args.steps}; KV cache of {args.context} tokens, 1 thread)"
    )
    print("| rows | " + " | ".join(table) + " |")
    print("|---|" + "---|" * len(table))
    for i, r in enumerate(rows):
        print(f"| {r} | " + " | ".join(f"{v[i]:.1f}" for v in table.values()) + " |")
    top = rows.index(max(rows))
    for name, values in table.items():
        ratios = ", ".join(f"{r} rows {values[i] / values[top]:.2f}" for i, r in enumerate(rows))
        print(f"{name}: against {max(rows)} rows: {ratios}")


if __name__ == "__main__":
    main()
