"""Model FLOPs of a round's phases and the device's peak, for the model FLOP utilisation
(MFU) of each phase: the FLOPs the phase had to do (padding left out) over its seconds, over
the peak matrix throughput of the device in the model's dtype.

FLOPs are counted from the model's shapes, as PaLM's appendix B counts them (Chowdhery et
al., 2022, arXiv:2204.02311): a token at position ``c`` of a sequence costs, in a forward
pass,

    2·P + 4·L·d·c

where ``P`` is the weights of the model's matrix multiplications (every ``nn.Linear``, the
vocabulary projection included, tied or not: ``in × out`` each), ``L`` the decoder layers and
``d`` the attention width (query heads × head dimension): ``Q·Kᵀ`` and ``A·V`` cost
``2·d·c`` each. Attention is counted causally (a token attends to the ``c`` positions up to
it), so a forward pass over a sequence of ``T`` tokens is ``Σ_{c=1..T}`` of the above,
``2·P·T + 2·L·d·T·(T+1)``; generating ``r`` tokens after a prompt of ``p`` with a KV cache
runs positions ``1 .. p+r-1`` once each, the forward of ``p + r - 1`` tokens. A backward pass
costs twice its forward when the weights get gradients (input and weight gradients) and once
when they are frozen (LoRA: the input gradients only; the adapters' own are negligible).
Embedding lookups, norms, activations and the softmax are not matrix work and are not
counted.

The peak is measured, not read from a datasheet: the best of a few plain square
multiplications in the dtype on the device (:func:`peak_flops`), cached per machine, device,
dtype, thread count and torch version in the user's cache folder, so a run measures it once.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ppokit.metrics_table import FLOP_PHASES, FLOPS, MFU

if TYPE_CHECKING:
    from ppokit.spec import Spec
    from ppokit.trainer.models import Models

__all__ = [
    "DTYPES",
    "PEAK_SIZE",
    "Passes",
    "Shape",
    "generation_positions",
    "peak_flops",
    "phase_peaks",
    "utilisation",
]

#: The dtypes a phase may compute in, by the name a spec gives them.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: The side of the square matrices :func:`peak_flops` multiplies.
PEAK_SIZE = 2048


@dataclass(frozen=True)
class Shape:
    """What a model's FLOPs depend on: ``matmul`` (P: Σ in × out of its linear layers),
    ``layers`` (L) and ``width`` (d: the attention's query heads × head dimension)."""

    matmul: int
    layers: int
    width: int

    @classmethod
    def of(cls, model: nn.Module) -> Shape:
        """The shape of a ``transformers`` decoder (through a peft wrapper too)."""
        config: Any = model.config
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        matmul = sum(
            m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear)
        )
        return cls(matmul, int(config.num_hidden_layers), heads * head_dim)

    def forward(self, lengths: Tensor, causal: bool = True) -> Tensor:
        """FLOPs of one forward pass over sequences of ``lengths`` tokens (float64, summed
        over the sequences): ``Σ 2·P·T + 2·L·d·T·(T+1)``; ``causal`` False counts every
        query against every key, ``4·L·d·T²``, as a dense attention kernel does."""
        t = lengths.to(torch.float64)
        attention = t * (t + 1) / 2 if causal else t * t
        return self.of_sums(t.sum(), attention.sum())

    def of_sums(self, tokens: Tensor, pairs: Tensor) -> Tensor:
        """FLOPs of forwards over ``tokens`` positions in all, whose queries meet ``pairs``
        keys in all (``Σ T·(T+1)/2`` causally): ``2·P·tokens + 4·L·d·pairs``."""
        return 2 * self.matmul * tokens + 4 * self.layers * self.width * pairs

    def generation(self, prompts: Tensor, responses: Tensor) -> Tensor:
        """FLOPs of generating ``responses`` tokens after ``prompts`` tokens (per row) with a
        KV cache (:func:`generation_positions`)."""
        return self.forward(generation_positions(prompts, responses))


def generation_positions(prompts: Tensor, responses: Tensor) -> Tensor:
    """The positions generation runs the model at, per row: ``p + r - 1`` (the last sampled
    token is never fed back), 0 for an empty response."""
    return torch.where(responses > 0, prompts + responses - 1, 0)


@dataclass(frozen=True)
class Passes:
    """The FLOPs of the passes a round runs over its rows (``lengths``: prompt + response
    tokens of each row): the actor (and the reference, the same shape) and a separate
    critic's trunk (``critic``; None without a critic, or with one sharing the actor's
    trunk, whose head is negligible). ``backward``: a backward pass over its forward, 2
    when every weight trains, 1 with LoRA (the frozen weights' input gradients only).
    Gradient checkpointing's recomputed forwards are not counted: model FLOPs are the work
    the model needs, not what the hardware ran."""

    actor: Shape
    critic: Shape | None
    backward: int
    #: the no-grad forwards of the actor's shape a round runs: log π_old when it is
    #: recomputed, the reference, a shared critic's trunk
    actor_runs: int

    @classmethod
    def of(cls, models: Models, recompute_logp_old: bool) -> Passes:
        critic = models.critic
        shared = critic is not None and models.shared_critic
        separate = critic is not None and not shared and critic.trunk is not None
        shape = Shape.of(critic.trunk) if separate else None  # type: ignore[union-attr, arg-type]
        runs = int(recompute_logp_old) + int(models.has_reference) + int(shared)
        return cls(Shape.of(models.actor), shape, 1 if models.lora else 2, runs)

    def no_grad(self, lengths: Tensor) -> Tensor:
        """The forwards without gradients: ``actor_runs`` of the actor's shape and a
        separate critic's values."""
        flops = self.actor_runs * self.actor.forward(lengths)
        return flops + self.critic.forward(lengths) if self.critic is not None else flops

    def update(self, lengths: Tensor, epochs: int, actor: bool) -> Tensor:
        """``epochs`` passes of forward and backward over every row: the actor's (when it
        trains) and the critic's."""
        flops = (1 + self.backward) * self.actor.forward(lengths) * float(actor)
        if self.critic is not None:
            flops = flops + 3 * self.critic.forward(lengths)
        return epochs * flops


def _machine() -> str:
    """The processor this process runs on, as the OS names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "ppokit" / "peak_flops.json"


def _key(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{_machine()} x{torch.get_num_threads()} threads"
    return f"{where} | {device.type} | {dtype} | torch {torch.__version__}"


def _read_cache(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and v > 0}


def _measure(device: torch.device, dtype: torch.dtype, repeats: int = 3) -> float:
    n = PEAK_SIZE
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The device's matrix throughput in ``dtype`` (FLOP/s): the best of a few ``PEAK_SIZE``
    square multiplications, measured once per machine, device, dtype, thread count and torch
    version and kept in ``~/.cache/ppokit/peak_flops.json`` (``$XDG_CACHE_HOME``); a cache
    that cannot be read or written is measured again."""
    path, key = _cache_file(), _key(device, dtype)
    known = _read_cache(path)
    if key in known:
        return known[key]
    with torch.no_grad():
        peak = _measure(device, dtype)
    known[key] = peak
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass
    return peak


def phase_peaks(spec: Spec, models: Models) -> dict[str, float]:
    """Each phase's peak (FLOP/s) at this process's thread count: the trainer's passes in
    its compute dtype (the autocast dtype, else the weights'), generation in the engine's
    ``dtype`` where it names one, else the trainer's."""
    runtime = models.runtime
    trainer = runtime.amp_dtype or next(models.actor.parameters()).dtype
    engine = DTYPES.get(str(spec.rollout.engine.params.get("dtype")), trainer)
    dtypes = {"generate": engine, "logprob": trainer, "update": trainer}
    return {phase: peak_flops(runtime.device, dtypes[phase]) for phase in FLOP_PHASES}


def utilisation(
    record: dict[str, Any], peaks: dict[str, float], processes: int
) -> dict[str, float]:
    """``mfu_<phase>`` of a round's ``record``: its ``flops_<phase>`` (the whole round's)
    over its ``time_<phase>`` seconds, over the peak of the ``processes`` devices."""
    out = {}
    for phase in FLOP_PHASES:
        flops, seconds = record.get(FLOPS[phase]), record.get(f"time_{phase}")
        if flops and seconds:
            out[MFU[phase]] = flops / (seconds * peaks[phase] * processes)
    return out
