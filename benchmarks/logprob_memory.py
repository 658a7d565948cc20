"""Peak memory of token log-probs + entropies with backward: ppokit's chunked computation
(:func:`ppokit.trainer.logprobs.token_logprobs`) against the naive full-logits
``log_softmax``.

Each variant runs in a fresh subprocess: it builds the same seeded hidden states ``[B, T, H]``
(requiring grad), LM head ``[V, H]`` and targets, runs the variant once on one position
(lazy initialisation), records the memory in use, computes
Σ w·log π + Σ u·entropy with fixed random weights w, u, runs backward, and reports its peak:
on CPU the process's max resident set size (``ru_maxrss``), with ``--device cuda``
``torch.cuda.max_memory_allocated``. The table shows the peak and the peak above the memory in
use before the pass. The parent then checks that both variants give the same log-probs,
entropies and gradients (of the hidden states and of the head).

    python benchmarks/logprob_memory.py [--shape BxTxHxV] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppokit.trainer.logprobs import token_logprobs

DEFAULT_SHAPE = (16, 512, 256, 32000)
VARIANTS = ("chunked", "naive")


def naive(hidden: Tensor, head: nn.Module, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Full ``[B, T, V]`` float32 logits, ``log_softmax``, gather and entropy."""
    logsm = F.log_softmax(head(hidden).float(), dim=-1)
    logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, -(logsm.exp() * logsm).sum(-1)


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _current_rss_gib() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * resource.getpagesize() / 2**30


def run_variant(variant: str, shape: tuple[int, ...], device: str, out: Path) -> dict:
    """One variant in this process; saves its outputs and gradients to ``out``."""
    b, t, h, v = shape
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=gen) / h**0.5)
    hidden = torch.randn(b, t, h, generator=gen)
    targets = torch.randint(0, v, (b, t), generator=gen)
    w, u = torch.rand(b, t, generator=gen), torch.rand(b, t, generator=gen)
    head.to(device)
    hidden = hidden.to(device).requires_grad_(True)
    targets, w, u = targets.to(device), w.to(device), u.to(device)
    fn = token_logprobs if variant == "chunked" else naive
    warm = hidden[:1, :1].detach().requires_grad_(True)  # lazy initialisation, tiny sizes
    sum(x.sum() for x in fn(warm, head, targets[:1, :1])).backward()
    head.zero_grad(set_to_none=True)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**30
    else:
        before = _current_rss_gib()
    start = time.perf_counter()
    logp, ent = fn(hidden, head, targets)
    ((logp * w).sum() + (ent * u).sum()).backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = _rss_gib()
    seconds = time.perf_counter() - start
    assert hidden.grad is not None and head.weight.grad is not None
    torch.save(
        {
            "logp": logp.detach().cpu(),
            "entropy": ent.detach().cpu(),
            "grad_hidden": hidden.grad.cpu(),
            "grad_head": head.weight.grad.cpu(),
        },
        out,
    )
    return {"variant": variant, "peak_gib": peak, "before_gib": before, "seconds": seconds}


def _shape(text: str) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.lower().split("x"))
    if len(parts) != 4:
        raise argparse.ArgumentTypeError("expected BxTxHxV, e.g. 16x512x256x32000")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=_shape, default=DEFAULT_SHAPE, help="B x T x H x V")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:  # the subprocess
        print(json.dumps(run_variant(args.variant, args.shape, args.device, args.out)))
        return
    b, t, h, v = args.shape
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
        f"B={b} T={t} H={h} V={v} (full float32 logits: {b * t * v * 4 / 2**30:.2f} GiB)"
    )
    measure = "max RSS" if torch.device(args.device).type == "cpu" else "max allocated"
    results, saved = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            out = Path(tmp) / f"{variant}.pt"
            cmd = [sys.executable, __file__, "--variant", variant, "--device", args.device]
            cmd += ["--shape", "x".join(map(str, args.shape)), "--out", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(f"{variant} failed:\n{proc.stderr}")
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            saved[variant] = torch.load(out)
    print(f"{'variant':<10}{'peak GiB':>10}{'above start GiB':>17}{'seconds':>9}   ({measure})")
    for variant in VARIANTS:
        r = results[variant]
        above = r["peak_gib"] - r["before_gib"]
        print(f"{variant:<10}{r['peak_gib']:>10.2f}{above:>17.2f}{r['seconds']:>9.1f}")
    c, n = results["chunked"], results["naive"]
    print(
        f"naive/chunked peak: {n['peak_gib'] / c['peak_gib']:.2f}; above start: "
        f"{(n['peak_gib'] - n['before_gib']) / (c['peak_gib'] - c['before_gib']):.2f}"
    )
    for key in ("logp", "entropy", "grad_hidden", "grad_head"):
        a, e = saved["chunked"][key], saved["naive"][key]
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
        print(f"{key:<12} max |chunked - naive| = {(a - e).abs().max().item():.2e}")
    print("values and gradients agree (atol 1e-4, rtol 1e-4)")


if __name__ == "__main__":
    main()
