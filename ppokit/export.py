"""``ppokit export RUN_DIR OUT_DIR [--critic]``: a run's trained policy as a Hugging Face
model directory.

``OUT_DIR`` gets the policy of the run's latest checkpoint (LoRA adapters merged into the
weights), loadable by ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and
``AutoTokenizer.from_pretrained(OUT_DIR)`` in any transformers-based tool::

    OUT_DIR/
      config.json, model.safetensors   the policy (float32 weights)
      generation_config.json           sampling as the run's rollouts sampled
      tokenizer files                  the run's tokenizer (the tiny model's character one too)
      critic/                          with --critic: the value model
        config.json, model.safetensors   its trunk (AutoModel.from_pretrained(OUT_DIR/critic))
        value_head.safetensors           the value head: weight [head_size, hidden], bias
        value_head.json                  head_size, how to read the value, the run it came from

The checkpoint is verified (every checksum of its manifest) before anything is read, and
nothing in the run folder changes. A checkpoint written by several processes (each its own
shards) is read whole in this one process by ``torch.distributed.checkpoint``. ``OUT_DIR``
must be new or empty; it is written through a temporary sibling folder and renamed into
place, so it is complete or absent.

This module imports no torch until a command runs.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import os
from pathlib import Path
from typing import Any

import typer

from ppokit.errors import UserError, error_lines, fail
from ppokit.runfolder import (
    CHECKPOINT,
    has_checkpoint,
    io_error,
    io_errors,
    link_error,
    read_run_spec,
    remove,
)
from ppokit.spec import Spec, SpecError, validate_spec

__all__ = [
    "CRITIC_DIR",
    "VALUE_HEAD_FILE",
    "VALUE_HEAD_JSON",
    "export_command",
    "export_run",
]

CRITIC_DIR = "critic"
VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_HEAD_JSON = "value_head.json"
VALUE_HEAD_FORMAT = 1


def _readable(folder: Path) -> None:
    """Files as the umask allows (some writers create theirs 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for file in folder.rglob("*"):
        if file.is_file():
            file.chmod(0o666 & ~mask)


def _check_out(out: Path, run_dir: Path) -> None:
    if out.is_symlink():  # a dangling one too: the export would land where it points
        raise UserError(f"{out} is a symbolic link: export into a real folder")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")
    above = out.parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise UserError(f"{above} is not a directory: cannot export into {out}")
    with io_errors(out, "cannot read"):
        if out.is_dir() and any(out.iterdir()):
            raise UserError(f"{out} is not empty: export into a new or empty folder")
    resolved, run = out.resolve(), run_dir.resolve()
    if resolved == run or run in resolved.parents:
        raise UserError(f"{out} is inside the run folder {run_dir}: export somewhere else")


def _critic_loss(spec: Spec) -> Any:
    """The run's regression loss component: it sets the head's width and how to read it."""
    from ppokit.registry import get_registry
    from ppokit.slots import slot

    assert spec.critic is not None
    comp = spec.critic.loss
    return get_registry().create(slot("critic.loss").kind, comp.name, **comp.params)


def _reads_first_column(read: Any, head_size: int) -> bool:
    """Whether a regression loss's ``value(head_out)`` is ``head_out[..., 0]``."""
    import torch

    probe = torch.randn(2, 3, head_size, generator=torch.Generator().manual_seed(0))
    try:
        return bool(torch.equal(read(probe).float(), probe[..., 0]))
    except Exception:  # a plugin's value() may want other shapes: describe it instead
        return False


def _value_description(spec: Spec, loss: Any, head_size: int, hidden_size: int) -> dict[str, Any]:
    """value_head.json: what the head reads and how its output becomes a value."""
    assert spec.critic is not None
    comp = spec.critic.loss
    read = getattr(loss, "value", None)
    value = "head_out[..., 0]"
    if read is not None and not _reads_first_column(read, head_size):
        target = getattr(read, "__func__", read)
        doc = (inspect.getdoc(read) or "").strip().splitlines()
        value = f"{target.__module__}.{target.__qualname__}(head_out)" + (
            f": {doc[0]}" if doc else ""
        )
    return {
        "format": VALUE_HEAD_FORMAT,
        "critic": spec.model.critic,
        "head_size": head_size,
        "hidden_size": hidden_size,
        "input": "the trunk's last hidden state at each position (the state after reading "
        "the tokens up to it), cast to float32",
        "head": "head_out = hidden @ weight.T + bias, float32 [..., head_size]",
        "value": value,
        "regression_loss": {"name": comp.name, "params": comp.params},
        "trunk": "AutoModel.from_pretrained of this folder"
        + (
            " (the policy's own trunk: the critic is shared)"
            if spec.model.critic == "shared"
            else ""
        ),
    }


def _generation_config(policy: Any, tokenizer: Any, spec: Spec) -> Any:
    """The policy's generation config, sampling as the run's rollouts did."""
    from transformers import GenerationConfig

    from ppokit.trainer.rollout import eos_ids

    base = getattr(policy, "generation_config", None)
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    r = spec.rollout
    config.update(
        do_sample=True,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids(tokenizer, policy),
    )
    return config


def _save_pretrained(model: Any, folder: Path) -> None:
    from ppokit.trainer.converted import without_gguf_marker

    without_gguf_marker(model)
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4; v5 always writes safetensors
    model.save_pretrained(folder, **kwargs)


def _write(tmp: Path, run_dir: Path, with_critic: bool, trust_remote_code: bool) -> dict[str, Any]:
    """Export into the empty folder ``tmp``; returns the summary."""
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    from ppokit.trainer.checkpoint import check_critic, load_weights
    from ppokit.trainer.checkpoint.layout import state_of
    from ppokit.trainer.checkpoint.read import locate
    from ppokit.trainer.models import build_models, trunk_of

    hf_logging.set_verbosity_error()
    path = locate(run_dir)  # verifies the manifest and every checksum
    state = state_of(path)
    spec_file = path / "spec.yaml"
    try:
        spec = validate_spec(read_run_spec(spec_file, trust_remote_code=trust_remote_code))
    except SpecError as exc:
        raise SpecError(exc.errors, source=exc.source or str(spec_file)) from None
    if with_critic and spec.critic is None:
        raise UserError(
            f"--critic: the run {run_dir} has no critic (its spec has no critic section)"
        )
    loss = _critic_loss(spec) if with_critic else None
    head_size = int(getattr(loss, "head_size", 1))
    models = build_models(spec, head_size, reference=False, critic=with_critic, device="cpu")
    load_weights(path, "actor", models.actor, models)
    critic = models.critic
    if critic is not None:
        check_critic(path, state, models)
        load_weights(path, "critic", critic.head if models.shared_critic else critic, models)
    critic_trunk: Any = None  # a peft model when models.lora
    if critic is not None and critic.trunk is not None:
        critic_trunk = critic.trunk
        if models.lora:  # its frozen weights are the actor's: merge a copy of its own
            critic_trunk = copy.deepcopy(critic_trunk).merge_and_unload()
    actor: Any = models.actor  # a peft model when models.lora
    policy = actor.merge_and_unload() if models.lora else actor
    policy.eval()
    policy.generation_config = _generation_config(policy, models.tokenizer, spec)
    _save_pretrained(policy, tmp)
    models.tokenizer.save_pretrained(tmp)
    summary: dict[str, Any] = {
        "round": int(state["round"]),
        "lora_merged": models.lora,
        "parameters": sum(p.numel() for p in policy.parameters()),
        "critic": None,
    }
    if critic is not None:
        folder = tmp / CRITIC_DIR
        folder.mkdir()
        _save_pretrained(critic_trunk if critic_trunk is not None else trunk_of(policy), folder)
        head = {k: v.detach().cpu().contiguous() for k, v in critic.head.state_dict().items()}
        save_file(head, str(folder / VALUE_HEAD_FILE), metadata={"format": "pt"})
        description = _value_description(spec, loss, head_size, int(critic.head.weight.shape[1]))
        description["source"] = {"run": str(run_dir), "round": summary["round"]}
        (folder / VALUE_HEAD_JSON).write_text(json.dumps(description, indent=2) + "\n")
        summary["critic"] = CRITIC_DIR
    return summary


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    critic: bool = False,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Export the policy of ``run_dir``'s latest checkpoint (and with ``critic`` its value
    model) to ``out_dir``; returns a summary (round, parameters, whether LoRA was merged).

    Raises :class:`UserError` (one line) for a folder without a checkpoint, a checkpoint
    that does not verify, an ``out_dir`` that is not new or empty (or is a link, or cannot
    be written), ``critic`` for a run without one, a run's spec that asks to run its
    model's code without ``trust_remote_code``; :class:`SpecError` for a spec that no
    longer validates.
    """
    run_dir, out = Path(run_dir).expanduser(), Path(out_dir).expanduser()
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a run folder (no such directory)")
    if not has_checkpoint(run_dir):
        raise UserError(
            f"{run_dir}: no checkpoint to export ({run_dir / CHECKPOINT} does not exist; a run "
            "writes it every output.save_every rounds and at its end)"
        )
    _check_out(out, run_dir)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    with io_errors(out.parent, "cannot create the export folder"):
        out.parent.mkdir(parents=True, exist_ok=True)
        remove(tmp)  # a leftover, or a link (itself)
        tmp.mkdir()
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        summary = _write(tmp, run_dir, critic, trust_remote_code)
        try:
            _readable(tmp)
            if out.is_symlink():  # made while exporting: never written through
                raise link_error(out)
            if out.is_dir():
                out.rmdir()  # empty (checked above)
            tmp.rename(out)
        except OSError as exc:
            raise io_error(out, exc) from None
    finally:
        with contextlib.suppress(OSError):
            remove(tmp)
        if bars:
            hf_logging.enable_progress_bar()
    summary["out_dir"] = str(out)
    return summary


def export_command(
    run_dir: Path = typer.Argument(
        ..., help="A run folder (output.dir) with a checkpoint.", metavar="RUN_DIR"
    ),
    out_dir: Path = typer.Argument(
        ...,
        help="Where the Hugging Face model directory goes (a new or empty folder).",
        metavar="OUT_DIR",
    ),
    critic: bool = typer.Option(
        False, "--critic", help="Also write the value model (trunk + value head) to OUT_DIR/critic."
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Run the Python code the run's spec names: its model's, when it sets "
        "model.trust_remote_code, and a python reward's function; contact the servers its "
        "rewards name (http, judge) (off: such a run is refused; a run folder is data).",
    ),
) -> None:
    """Write a run's trained policy as a Hugging Face model directory (LoRA merged).

    Load it with AutoModelForCausalLM.from_pretrained(OUT_DIR) and
    AutoTokenizer.from_pretrained(OUT_DIR).
    """
    try:
        summary = export_run(run_dir, out_dir, critic=critic, trust_remote_code=trust_remote_code)
    except (UserError, SpecError) as exc:
        raise fail(error_lines(exc)) from None
    merged = ", LoRA adapters merged" if summary["lora_merged"] else ""
    typer.echo(
        f"exported round {summary['round']} of {run_dir} ({summary['parameters']:,} "
        f"parameters{merged}) to {summary['out_dir']}"
    )
    if summary["critic"]:
        typer.echo(f"value model: {Path(summary['out_dir']) / summary['critic']}")
