"""The ``vllm`` rollout engine: vLLM in the training process, token ids in and out.

At ``start`` the actor's config and current weights (the base weights under LoRA) are
written to a temporary model folder and vLLM loads it, without a tokenizer; after every
update ``sync`` pushes the actor's weights into vLLM (``reload_weights``), or with LoRA only
the adapters (a new ``LoRARequest`` each time, never a merged copy). On several processes
each one drives its own engine over its share of the prompts, and the sharded weights are
gathered once a push. The trainer recomputes log π_old (``samples_from_policy`` False).

Imports vLLM, torch and :mod:`ppokit.distributed`; the catalogue entry and its parameters
are in :mod:`ppokit.components.rollout_engine`, which imports none of them.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from ppokit.bounded import TimedOut, deadline
from ppokit.components.rollout_engine import (
    VLLM,
    VLLM_CPU_HEAD_SIZES,
    VLLM_INSTALL,
    EngineContext,
    Generation,
    Sampling,
    lora_rank,
)
from ppokit.errors import MissingDependency, UserError, one_line

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["VLLMEngine", "adapter_weights", "base_weights", "lora_rank", "write_adapter"]

#: The head sizes vLLM's CPU attention supports (stated in the catalogue, which ``ppokit
#: validate`` checks a spec against).
CPU_HEAD_SIZES = VLLM_CPU_HEAD_SIZES


#: torch.set_num_threads as it is before an engine starts: vLLM's CPU worker makes it a no-op
#: while it runs, and :meth:`VLLMEngine.close` puts it back for the rest of the process.
SET_NUM_THREADS = torch.set_num_threads

#: vLLM's loggers whose warnings say nothing wrong here: the chat-template warmup that a
#: folder without a tokenizer fails, a rotary embedding's cache that a weight push leaves in
#: place, and ``torch.set_num_threads`` made a no-op once vLLM has bound its threads.
_QUIET = (
    "vllm.renderers.base",
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.v1.worker.cpu_worker",
)


def _import_vllm() -> Any:
    """vLLM, set up to run inside this process (no engine-core subprocess)."""
    if importlib.util.find_spec("vllm") is None:
        raise MissingDependency("vllm", "rollout.engine: vllm", VLLM_INSTALL)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import vllm

    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.ERROR)
    return vllm


def _peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _full(x: Tensor) -> Tensor:
    """A plain tensor of a parameter (a DTensor's whole value: a collective)."""
    from ppokit.distributed import full_tensor

    return full_tensor(x.detach())


def base_weights(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(checkpoint name, whole tensor) of each weight of the actor's causal LM, as
    ``save_pretrained`` names them; under LoRA the frozen base weights (peft's
    ``base_layer`` names mapped back, the adapters left out). Sharded parameters are
    gathered one at a time, in the same order on every process; ``dtype``: cast to it."""
    lm = model.get_base_model() if _peft(model) else model  # type: ignore[operator]
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    for name, tensor in lm.state_dict(keep_vars=True).items():
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        if tied and name == "lm_head.weight":
            continue
        whole = _full(tensor)
        yield name, whole if dtype is None else whole.to(dtype)


def adapter_weights(model: nn.Module) -> dict[str, Tensor]:
    """The actor's LoRA adapters as peft saves them (adapter name left out of the keys),
    gathered whole."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    return {k: _full(v).contiguous().cpu() for k, v in state.items()}


def _config(model: nn.Module) -> PretrainedConfig:
    """The actor's transformers config (the base model's under LoRA)."""
    lm = model.get_base_model() if _peft(model) else model  # type: ignore[operator]
    return cast("PretrainedConfig", lm.config)  # nn.Module types attributes as modules


def _write_model(model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """The actor's config and weights (the base model's under LoRA) as a model folder."""
    from safetensors.torch import save_file

    config = copy.deepcopy(_config(model))
    if hasattr(config, "quantization_config"):  # a GGUF file's: the weights are dequantized
        del config.quantization_config
    config.save_pretrained(folder)
    weights = {name: t.contiguous().cpu() for name, t in base_weights(model, dtype)}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_adapter(model: nn.Module, folder: Path) -> None:
    """The actor's LoRA adapters as a peft adapter folder."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = model.peft_config["default"].to_dict()  # type: ignore[index, union-attr, operator]
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    (folder / "adapter_config.json").write_text(json.dumps(config, default=str))
    save_file(adapter_weights(model), str(folder / "adapter_model.safetensors"))


@contextlib.contextmanager
def _own_random_state() -> Iterator[None]:
    """The block leaves Python's, NumPy's and torch's global generators as they were: vLLM
    seeds them all when it starts inside the process, and the trainer's draws (minibatch
    order, the hf engine's sampling) follow the spec's seed, not vLLM's."""
    import random

    python = random.getstate()
    numpy = None
    with contextlib.suppress(ImportError):
        import numpy as np

        numpy = np.random.get_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(python)
    if numpy is not None:
        np.random.set_state(numpy)


def _bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """``fn()`` for at most ``timeout`` seconds (:func:`ppokit.bounded.deadline`): a stuck
    call is a ``TimeoutError``, not a hang."""
    try:
        with deadline(timeout, what):
            return fn()
    except TimedOut:
        raise TimeoutError(
            f"{what} did not finish within rollout.engine.sync_timeout_s ({timeout:g} s)"
        ) from None


#: The prefix of the folder that holds the weights vLLM loads, in the temporary directory;
#: the process id that made it follows (a killed run's folder is removed by the next start).
FOLDER_PREFIX = "ppokit-vllm-"


def new_folder(tag: str = "") -> Path:
    """A new folder for the weights vLLM loads, named for this process (then ``tag``);
    first the folders of processes that no longer run (a run killed before its ``close``)
    are removed (this user's own, never through a link)."""
    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for old in root.glob(f"{FOLDER_PREFIX}*"):
            pid = old.name[len(FOLDER_PREFIX) :].partition("-")[0]
            if not pid.isdigit() or int(pid) == os.getpid() or old.is_symlink():
                continue
            try:
                if old.stat().st_uid != os.getuid():
                    continue
                os.kill(int(pid), 0)
            except ProcessLookupError:  # its process is gone
                shutil.rmtree(old, ignore_errors=True)
            except OSError:  # alive (another user's process), or not ours to judge
                continue
    return Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-{tag}"))


def start_error(exc: Exception, kv_cache_gb: float | None, max_len: int | None) -> UserError:
    """What vLLM's failure to start means for the spec: a KV cache too small for one
    request of ``max_len`` tokens names ``rollout.engine.kv_cache_gb``."""
    text = " ".join(str(exc).split())
    if "KV cache" in text or "cache blocks" in text:
        size = f"{kv_cache_gb:g} GiB" if kv_cache_gb is not None else "what was left"
        return UserError(
            f"rollout.engine.kv_cache_gb: vLLM's KV cache ({size}) cannot hold one request of "
            f"max_model_len {max_len} tokens: raise rollout.engine.kv_cache_gb (GPUs: or "
            "gpu_memory_fraction) or lower rollout.engine.max_model_len "
            f"(vLLM: {text.split('. ')[0]})"
        )
    return UserError(f"rollout.engine: vLLM did not start: {one_line(exc)}")


def _tp_group(size: int) -> Any:
    """The process group of this process's tensor-parallel engine (consecutive ranks)."""
    import torch.distributed as dist

    from ppokit.distributed import world

    group, _ = dist.new_subgroups_by_enumeration(
        [list(range(i, i + size)) for i in range(0, world().size, size)]
    )
    return group


@VLLM.implementation
class VLLMEngine:
    """vLLM colocated with the trainer; see the module docstring."""

    samples_from_policy = False

    def __init__(
        self,
        *,
        dtype: str,
        max_model_len: int | None,
        kv_cache_gb: float | None,
        gpu_memory_fraction: float,
        tensor_parallel_size: int,
        enforce_eager: bool,
        sleep: bool,
        sync_timeout_s: float,
    ) -> None:
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gb = kv_cache_gb
        self.gpu_memory_fraction = gpu_memory_fraction
        self.tensor_parallel_size = tensor_parallel_size
        self.enforce_eager = enforce_eager
        self.sleep = sleep
        self.sync_timeout_s = sync_timeout_s
        self.context: EngineContext | None = None
        self.llm: Any = None
        self.folder: Path | None = None
        self.max_len: int | None = None
        self.lora: Any = None  # the current LoRARequest
        self.pushes = 0
        self.asleep = 0  # vLLM's sleep level now (0: awake)
        self.tp_group: Any = None
        self.torch_dtype = torch.float32  # vLLM's, resolved at the start

    @property
    def _started(self) -> EngineContext:
        """The context of :meth:`start` (an error before it, or after :meth:`close`)."""
        if self.context is None:
            raise RuntimeError("the vllm engine was not started")
        return self.context

    # ------------------------------------------------------------------ start
    def _resolved_dtype(self, context: EngineContext, gpu: bool) -> str:
        if self.dtype != "auto":
            return self.dtype
        wanted = getattr(context.model_spec, "dtype", "auto")
        if wanted in ("float32", "bfloat16", "float16"):
            return str(wanted)
        cast = context.autocast()  # the run's: model.dtype auto decided it for this device
        if isinstance(cast, torch.autocast):
            return str(cast.fast_dtype).removeprefix("torch.")
        return "bfloat16" if gpu else "float32"

    def _check_model(self, model: nn.Module, gpu: bool) -> None:
        config = _config(model)
        heads = getattr(config, "num_attention_heads", None)
        head = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
        if not gpu and head is not None and head not in CPU_HEAD_SIZES:
            raise UserError(
                f"rollout.engine: vllm on a CPU supports attention heads of "
                f"{', '.join(map(str, CPU_HEAD_SIZES))} dimensions; the actor's have {head} "
                "(for the tiny model hidden_size / num_attention_heads, e.g. "
                "model.tiny.num_attention_heads=2 and num_key_value_heads=2)"
            )

    def start(self, context: EngineContext) -> None:
        vllm = _import_vllm()
        self.context = context
        model = context.model
        gpu = torch.device(context.device).type == "cuda"
        self._check_model(model, gpu)
        if self.sleep and not gpu:
            warnings.warn(
                "rollout.engine.sleep applies on GPUs only: ignored on a CPU", stacklevel=2
            )
            self.sleep = False
        if self.tensor_parallel_size > 1 and not gpu:
            raise UserError("rollout.engine.tensor_parallel_size: more than 1 needs GPUs")
        if context.processes > 1 and context.processes % self.tensor_parallel_size:
            raise UserError(
                f"rollout.engine.tensor_parallel_size ({self.tensor_parallel_size}) must "
                f"divide the run's {context.processes} processes"
            )
        self.folder = new_folder()
        self.torch_dtype = getattr(torch, self._resolved_dtype(context, gpu))
        _write_model(model, self.folder / "model", self.torch_dtype)
        config = _config(model)
        max_len = self.max_model_len or getattr(config, "max_position_embeddings", None)
        self.max_len = max_len
        kwargs: dict[str, Any] = dict(
            model=str(self.folder / "model"),
            skip_tokenizer_init=True,
            dtype=self._resolved_dtype(context, gpu),
            enforce_eager=self.enforce_eager,
            max_model_len=max_len,
            logprobs_mode="processed_logprobs",  # after temperature (and top-k/top-p)
            generation_config="vllm",  # no sampling defaults from the model's folder
            seed=context.process,
            tensor_parallel_size=self.tensor_parallel_size,
            enable_prefix_caching=True,
            use_tqdm_on_load=False,  # no progress bar through the trainer's display
        )
        gib = 1 << 30
        if gpu:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_fraction
            kwargs["enable_sleep_mode"] = self.sleep
            if context.processes == 1 and self.tensor_parallel_size > 1:
                kwargs["distributed_executor_backend"] = "mp"
        if self.kv_cache_gb is not None or not gpu:
            kwargs["kv_cache_memory_bytes"] = int((self.kv_cache_gb or 1.0) * gib)
        if context.processes > 1:  # the launcher's process group, every process an engine
            kwargs["distributed_executor_backend"] = "external_launcher"
            if self.tensor_parallel_size > 1:
                self.tp_group = _tp_group(self.tensor_parallel_size)
        lora = getattr(context.model_spec, "lora", None)
        if _peft(model):
            kwargs["enable_lora"] = True
            kwargs["max_lora_rank"] = lora_rank(int(lora.r if lora is not None else 8))
            kwargs["max_loras"] = 1
        # vLLM computes with torch's threads as they are now (then see SET_NUM_THREADS)
        with warnings.catch_warnings(), _own_random_state():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=FutureWarning)
            try:
                self.llm = vllm.LLM(**kwargs)
            except ValueError as exc:
                raise start_error(
                    exc, kwargs.get("kv_cache_memory_bytes", 0) / gib or None, max_len
                ) from exc
        if _peft(model):
            self._push_adapters()

    # ------------------------------------------------------------------ generate
    def _fits(self, prompt: int, new: int) -> None:
        """vLLM would cut a response that runs past ``max_model_len`` without a word: a
        prompt of ``prompt`` tokens and ``new`` more must fit."""
        if self.max_len is not None and prompt + new > self.max_len:
            raise UserError(
                f"rollout.engine.max_model_len: a prompt of {prompt} tokens and "
                f"{new} new tokens pass vLLM's max_model_len of {self.max_len}: vLLM would cut "
                "the responses; raise rollout.engine.max_model_len (null: the model's context) "
                "or lower rollout.max_new_tokens"
            )

    def _params(self, sampling: Sampling, seed: int | None, n: int) -> Any:
        from vllm import SamplingParams

        eos = list(self._started.eos_ids)
        if sampling.greedy:
            return SamplingParams(
                n=1,
                temperature=0.0,
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=eos,
                detokenize=False,
            )
        return SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_k=sampling.top_k,  # 0: off, as in vLLM
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=eos,
            ignore_eos=False,
            logprobs=0,  # the sampled token's own log-prob
            seed=seed,
            detokenize=False,
        )

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: Sampling) -> Generation:
        context = self.context
        if context is None or self.llm is None:
            raise RuntimeError("the vllm engine was not started")
        from vllm.inputs import TokensPrompt

        self._wake()
        ids, mask = prompt_ids.cpu(), prompt_mask.cpu().bool()  # one copy each
        prompts = [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]
        self._fits(max((len(p) for p in prompts), default=0), sampling.max_new_tokens)
        n = sampling.n
        if sampling.greedy and n > 1:  # vLLM draws one greedy response a request
            prompts = [p for p in prompts for _ in range(n)]
        per = 1 if sampling.greedy else n
        seeds = [
            None if sampling.seed is None else (sampling.seed + i * per) % (1 << 63)
            for i in range(len(prompts))
        ]
        if self.tp_group is not None:  # the group's engines generate the group's prompts
            prompts, seeds, share = self._group_prompts(prompts, seeds, per)
        params = [self._params(sampling, s, per) for s in seeds]
        self.llm.enqueue(
            # vllm imports NotRequired from typing, which mypy's Python 3.10 lacks: every key
            # of the TypedDict reads as required there
            [TokensPrompt(prompt_token_ids=p) for p in prompts],  # type: ignore[typeddict-item]
            params,
            use_tqdm=False,
            lora_request=self.lora,
        )
        outputs = self._run(sampling.max_new_tokens, len(prompts) * per)
        responses: list[list[int]] = []
        logps: list[list[float]] = []
        for out in outputs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(c.token_ids)
                responses.append(tokens)
                if not sampling.greedy:
                    logps.append(
                        [step[t].logprob for step, t in zip(c.logprobs, tokens, strict=True)]
                    )
        if self.tp_group is not None:
            responses = responses[share]
            logps = logps[share] if logps else logps
        if self.sleep:
            self._sleep()
        return Generation.from_token_lists(
            responses,
            None if sampling.greedy else logps,
            context.eos_ids,
            context.pad_id,
            prompt_ids.device,
        )

    def _run(self, steps: int, rows: int) -> list[Any]:
        """The queued requests' outputs in their order, stepping vLLM's engine as
        ``LLM.generate`` does; each engine step is reported to the context's ``progress``
        (step 0 before the first). A step decodes one token of every running response
        while they fit vLLM's batch, so the count is the tokens done; it stops at
        ``steps`` (more steps: responses that waited for a place in the batch)."""
        engine = self.llm.llm_engine
        progress = self._started.progress
        if progress is not None:
            progress(0, steps, rows)
        done: list[Any] = []
        step = 0
        while engine.has_unfinished_requests():
            done.extend(out for out in engine.step() if out.finished)
            step += 1
            if progress is not None:
                progress(min(step, steps), steps, rows)
        return sorted(done, key=lambda out: int(out.request_id))

    def _group_prompts(
        self, prompts: list[list[int]], seeds: list[int | None], per: int
    ) -> tuple[list[list[int]], list[int | None], slice]:
        """Every prompt of the tensor-parallel group (a group's engines take the same
        requests) and the slice of the responses (``per`` a prompt) that are this process's."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.tensor_parallel_size
        dist.all_gather_object(gathered, (prompts, seeds), group=self.tp_group)
        before = sum(len(p) for p, _ in gathered[: dist.get_rank(self.tp_group)])
        every = [p for ps, _ in gathered for p in ps]
        every_seed = [s for _, ss in gathered for s in ss]
        return every, every_seed, slice(before * per, (before + len(prompts)) * per)

    # ------------------------------------------------------------------ sync
    def sync(self) -> None:
        """Push the updated policy into vLLM: the adapters under LoRA, else every weight."""
        if self.llm is None or self.context is None:
            raise RuntimeError("the vllm engine was not started")
        if _peft(self.context.model):
            self._push_adapters()
        else:
            self._push_weights()

    def _push_weights(self) -> None:
        context = self._started
        model = context.model
        if self.asleep:  # level 2: the weights were dropped; they come back as pushed
            self.llm.wake_up(tags=["weights"])
        weights: Any = base_weights(model, self.torch_dtype)  # one weight at a time
        if context.processes > 1:  # the gathers (collectives) on the trainer's thread
            weights = list(weights)
        elif self.tensor_parallel_size > 1:  # sent to vLLM's worker processes
            weights = [(k, v.cpu()) for k, v in weights]
        device = torch.device(context.device)

        def push() -> None:
            if device.type == "cuda":  # a thread starts on the first GPU
                torch.cuda.set_device(device)
            with torch.no_grad():
                self.llm.collective_rpc(
                    "reload_weights",
                    kwargs={"weights_iterator": weights, "is_checkpoint_format": True},
                )

        _bounded(push, self.sync_timeout_s, "the weight push into vLLM")
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = 0
        self.llm.reset_prefix_cache()
        self.pushes += 1

    def _push_adapters(self) -> None:
        from vllm.lora.request import LoRARequest

        if self.asleep:
            self.llm.wake_up()
            self.asleep = 0
        model = self._started.model
        self.pushes += 1
        folder = self.folder / f"adapter-{self.pushes}"  # type: ignore[operator]
        write_adapter(model, folder)
        previous = self.lora
        request = LoRARequest(f"actor-{self.pushes}", self.pushes, str(folder))

        def push() -> None:
            if previous is not None:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
            self.llm.llm_engine.add_lora(request)

        _bounded(push, self.sync_timeout_s, "the adapter push into vLLM")
        self.lora = request
        self.llm.reset_prefix_cache()
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    # ------------------------------------------------------------------ sleep
    def _sleep(self) -> None:
        """GPUs: free vLLM's KV cache and weights until the next push (level 2), or offload
        the frozen base weights to host memory under LoRA (level 1)."""
        level = 1 if self.lora is not None else 2
        self.llm.sleep(level=level)
        self.asleep = level

    def _wake(self) -> None:
        if not self.asleep:
            return
        if self.asleep == 2:  # a generation before the next push: the current weights
            self._push_weights()
        else:
            self.llm.wake_up()
            self.asleep = 0

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                with contextlib.suppress(Exception):  # closing is best effort
                    shutdown()
            del llm
            gc.collect()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        torch.set_num_threads = SET_NUM_THREADS  # the process's thread setting works again
        self.context = None
