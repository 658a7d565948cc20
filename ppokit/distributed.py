"""Several processes: PyTorch's process group (started by ``torchrun``), FSDP2 sharding and
the round-wide statistics.

A run started by ``torchrun`` (or ``ppokit train --nproc N``, which calls the same launcher)
has ``WORLD_SIZE`` processes; one process without a launcher has no process group and none
of this does anything. The contract (docs/design.md, "Several processes"):

- The round's prompts are split into equal contiguous shares, one per process in rank
  order; all ``rollout.n`` responses to a prompt stay on its process.
- Each process generates, scores and runs the no-grad forwards (log π_ref, V_old) for its
  own rows. The estimation then runs on the whole round: :func:`gather_rows` collects every
  process's rows of the batch's small fields (padded to the longest response of the
  round), every process runs the same components on the same whole batch, and keeps its own
  rows of the result. Whitening, group statistics, prompt weights, the adaptive KL
  controller and the collect-phase metrics are therefore exactly those of one process
  holding the whole round, for built-in and plugin components alike.
- In an update, each process holds its own rows of the minibatch; the aggregation
  denominators are computed on the gathered masks of the whole minibatch, every process's
  loss is its numerator over that global denominator, and FSDP2's gradient reduction sums
  the processes' gradients (its averaging is undone by scaling the loss by the number of
  processes). The gradient of one update is the single-process one.
- Metric sums and counts are summed over processes before they are divided.

Every collective here is one of ``torch.distributed``'s; nothing is hand-written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from ppokit.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from ppokit.spec import ParallelSpec

__all__ = [
    "PeerFailure",
    "World",
    "adopt",
    "all_sum",
    "as_forward",
    "each",
    "first_text",
    "gather_rows",
    "gathered",
    "launched",
    "local_tensor",
    "max_each",
    "process_group",
    "round_seed",
    "shard_model",
    "sharded",
    "world",
]


@dataclass(frozen=True)
class World:
    """This process's place among the run's processes (``size`` 1: no process group)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        """Whether this process writes the run's files and shows its progress."""
        return self.rank == 0

    def share(self, n: int) -> slice:
        """This process's contiguous share of ``n`` items (``n`` divisible by ``size``)."""
        each = n // self.size
        return slice(self.rank * each, (self.rank + 1) * each)


_WORLD = World()


def world() -> World:
    """The current process's :class:`World`."""
    return _WORLD


def adopt(other: World) -> None:
    """Take ``other`` as this process's :class:`World` without a process group: a worker
    process (:mod:`ppokit.workers`) running a component for a run's process reads that
    process's rank and size, and joins no collective."""
    global _WORLD
    _WORLD = other


def launched() -> bool:
    """Whether a launcher started this process as one of several (``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


@contextlib.contextmanager
def process_group(device_type: str, timeout_s: float) -> Iterator[World]:
    """Join the launcher's process group for the block (gloo on a CPU, nccl on GPUs; a
    collective that waits longer than ``timeout_s`` fails instead of hanging); without a
    launcher, the one-process :class:`World`."""
    global _WORLD
    if not launched():
        yield _WORLD
        return
    import torch
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    _WORLD = World(dist.get_rank(), dist.get_world_size(), local_rank)
    try:
        yield _WORLD
    except Exception as exc:
        if _peer_failed(exc):  # the failing process shows its own error
            raise PeerFailure(
                f"process {_WORLD.rank} stopped: another process failed or stopped answering "
                f"(its error, or how it ended, is shown with this; "
                f"parallel.timeout_s={timeout_s:g})"
            ) from None
        raise
    finally:
        _WORLD = World()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class PeerFailure(UserError):
    """A collective failed because another process died or stopped answering."""


_PEER_SIGNS = ("closed by peer", "reset by peer", "broken pipe", "timed out", "timeout")


def _peer_failed(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc).lower() for s in _PEER_SIGNS)


def round_seed(seed: int, rank: int, round_no: int) -> int:
    """The seed of one process's random streams in one round, from (seed, process, round):
    a run on several processes is reproducible and resumes without stored RNG states."""
    digest = hashlib.sha256(f"ppokit:{seed}:{rank}:{round_no}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ---------------------------------------------------------------- collectives
def all_sum(x: Tensor) -> Tensor:
    """``x`` summed over the processes (``x`` itself with one process)."""
    if not _WORLD.distributed:
        return x
    import torch.distributed as dist

    out = x.detach().clone()
    dist.all_reduce(out)
    return out


def gather_rows(x: Tensor, length: int | None = None) -> Tensor:
    """Every process's rows of ``x`` (each holds the same number), in rank order; a dim 1
    shorter than ``length`` (default: the longest over the processes) is padded with zeros
    on the right. With one process: ``x`` (padded to ``length`` when given)."""
    import torch
    import torch.distributed as dist

    if x.dim() >= 2:
        if length is None:
            length = max_over_processes(x.shape[1], x.device)
        if x.shape[1] < length:
            pad = x.new_zeros((x.shape[0], length - x.shape[1], *x.shape[2:]))
            x = torch.cat([x, pad], dim=1)
    if not _WORLD.distributed:
        return x
    wire = x.to(torch.uint8) if x.dtype == torch.bool else x.contiguous()
    parts = [torch.empty_like(wire) for _ in range(_WORLD.size)]
    dist.all_gather(parts, wire)
    out = torch.cat(parts)
    return out.bool() if x.dtype == torch.bool else out


def max_over_processes(n: int, device: torch.device) -> int:
    """The largest of every process's ``n``."""
    if not _WORLD.distributed:
        return n
    import torch
    import torch.distributed as dist

    t = torch.tensor(n, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def max_each(values: list[int], device: torch.device) -> list[int]:
    """Each position's largest value over every process's ``values`` (one collective; each
    process passes as many)."""
    if not _WORLD.distributed or not values:
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(x) for x in t.tolist()]


def barrier() -> None:
    """Wait for every process (nothing with one)."""
    if _WORLD.distributed:
        import torch.distributed as dist

        dist.barrier()


def each(value: Any) -> list[Any]:
    """Every process's ``value`` (small, picklable), in rank order, on every process."""
    if not _WORLD.distributed:
        return [value]
    import torch.distributed as dist

    box: list[Any] = [None] * _WORLD.size
    dist.all_gather_object(box, value)
    return box


def first_text(text: str | None) -> str | None:
    """The first (in rank order) process's ``text`` that is not None, on every process (a
    short message, e.g. the error one process met while the others did not)."""
    return next((t for t in each(text) if t is not None), None)


# ------------------------------------------------------------------ sharding
def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face model (its ``_no_split_modules`` classes),
    found under any wrapper (peft, a value model)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: nn.Module, parallel: ParallelSpec, device_type: str) -> nn.Module:
    """``model`` under FSDP2 (``fully_shard``): each transformer block, then the root.

    ``parallel.shard``: shard parameters, gradients and optimizer state over the processes
    (else replicate them: data parallel, gradients all-reduced); ``reshard_after_forward``;
    ``cpu_offload`` (GPUs); ``mixed_precision`` (GPUs: bf16 parameters, fp32 gradient
    reduction). Returns ``model`` (sharded in place)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if parallel.shard:
        mesh = init_device_mesh(device_type, (_WORLD.size,))
    else:  # HSDP with shards of one: every process holds everything
        mesh = init_device_mesh(device_type, (_WORLD.size, 1), mesh_dim_names=("dp", "shard"))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": parallel.reshard_after_forward}
    if device_type == "cuda" and parallel.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if parallel.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    _PARALLEL[model] = parallel
    return model


#: The ``parallel`` settings each sharded model was sharded with.
_PARALLEL: weakref.WeakKeyDictionary[nn.Module, ParallelSpec] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """Keep ``module``'s whole parameters on every process for the block, when it is
    sharded with ``parallel.gather_for_generation``: FSDP2 gathers each block at its first
    forward and keeps it (a decoding loop runs one forward per token, each of which would
    otherwise gather every block again); on leaving, every block is resharded and
    ``reshard_after_forward`` is as before. Otherwise nothing."""
    parallel = _PARALLEL.get(module)
    if parallel is None or not parallel.gather_for_generation:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    module.set_reshard_after_forward(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_reshard_after_forward(parallel.reshard_after_forward)  # type: ignore[operator]
        for part in module.modules():
            if isinstance(part, FSDPModule):
                part.reshard()


def sharded(module: nn.Module) -> bool:
    """Whether ``module`` is under FSDP2 (:func:`shard_model`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


_Out = TypeVar("_Out")


def as_forward(module: nn.Module, fn: Callable[[], _Out]) -> _Out:
    """``fn()`` run as ``module``'s forward when ``module`` is sharded (FSDP2 gathers its
    own parameters around its forward and reduces their gradients after its backward: a
    computation that uses them outside the module's ``forward``, such as a trunk followed
    by a chunked LM head, must run inside it); else just ``fn()``."""
    if not sharded(module):
        return fn()
    module.forward = lambda: fn()  # an instance attribute: hides the class's forward
    try:
        with warnings.catch_warnings():  # the trunk's states are a slice; none is changed
            warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view")
            return module()
    finally:
        del module.forward


def local_tensor(x: Tensor) -> Tensor:
    """This process's part of ``x`` (a DTensor's local shard; a plain tensor itself)."""
    local = getattr(x, "to_local", None)
    return local() if local is not None else x


def full_tensor(x: Tensor) -> Tensor:
    """A plain tensor of ``x`` (a DTensor's whole value, as on every process)."""
    full = getattr(x, "full_tensor", None)
    return full() if full is not None else x
