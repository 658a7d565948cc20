"""``ppokit serve-rollouts SPEC``: vLLM's OpenAI-compatible server for a spec's actor, started
with what the ``vllm_server`` rollout engine needs, and the ``rollout.engine`` line that
points a spec at it.

The server gets the actor's model folder (the ``tiny`` model and SmolLM2's GGUF file are
written as one first, config and weights; a local folder or a Hub id as it is: the engine
pushes the trainer's weights at its start anyway), no tokenizer (token ids in and out),
``--served-model-name`` :data:`~ppokit.components.rollout_engine.SERVED_NAME`,
``--logprobs-mode processed_logprobs`` (log μ after temperature, as the engine contract
asks), ``--generation-config vllm`` (no sampling defaults from the model's folder), the
spec's dtype (``auto``: float32 on a CPU), on a CPU a KV cache of 1 GiB, and
``VLLM_SERVER_DEV_MODE=1`` in its environment
(``/collective_rpc`` for the weight push, ``/server_info`` for the engine's checks); for a
spec with ``model.lora`` also ``--enable-lora``, ``--max-lora-rank`` (the smallest of
vLLM's ranks that holds ``model.lora.r``), ``--max-loras 1`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, the adapters' push). It
listens on loopback unless told otherwise; Ctrl-C or SIGTERM stops it and removes the model
folder written for it. Torch is imported only to write a model folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer

from ppokit.components.rollout_engine import (
    SERVED_NAME,
    VLLM_INSTALL,
    VLLM_LORA_ENV,
    lora_rank,
    vllm_on_cpu,
)
from ppokit.errors import MissingDependency, UserError

__all__ = ["engine_line", "serve_rollouts_command", "server_args", "write_model"]

#: The port ``ppokit serve-rollouts`` listens on by default (the engine's default URL's).
PORT = 8100
#: The KV cache of a server on a CPU unless ``--vllm-arg`` sizes it (the ``vllm`` engine's).
CPU_KV_CACHE_BYTES = 1 << 30


def write_model(spec: Any, folder: Path) -> Path:
    """The spec's actor (the ``tiny`` model as the trainer builds it, SmolLM2 converted) as a
    model folder, config and float32 weights, no tokenizer."""
    from ppokit.trainer.models import load_actor, quiet_progress_bars

    model = spec.model
    _, actor = load_actor(model.actor, model.tiny.model_dump(), spec.seed)
    with quiet_progress_bars():
        actor.save_pretrained(folder)  # type: ignore[operator]
    return folder


def _source(spec: Any) -> str | None:
    """The actor as vLLM can load it as it is (a local folder, a Hub id), else None."""
    actor = spec.model.actor
    if actor == "tiny" or actor.endswith(".gguf") or actor.startswith("smollm2"):
        return None
    return str(Path(actor).expanduser()) if Path(actor).expanduser().is_dir() else actor


def server_args(
    spec: Any, model: str, host: str, port: int, extra: list[str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """(the command, the environment) of vLLM's server for ``spec``'s actor in ``model``."""
    dtype = spec.model.dtype
    cpu = vllm_on_cpu(spec.model.device)
    if dtype == "auto":
        dtype = "float32" if cpu or cpu is None else "auto"
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", SERVED_NAME,
        "--dtype", dtype, "--skip-tokenizer-init",
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--host", host, "--port", str(port), "--seed", str(spec.seed),
    ]  # fmt: skip
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    if spec.model.trust_remote_code:
        args.append("--trust-remote-code")
    lora = spec.model.lora
    if lora is not None:  # the adapters are loaded at run time, one version at a time
        args += ["--enable-lora", "--max-lora-rank", str(lora_rank(lora.r)), "--max-loras", "1"]
    extra = list(extra or [])
    sized = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
    if cpu is not False and not any(a.startswith(sized) for a in extra):
        # vLLM on a CPU reserves most of the machine's memory unless told a KV cache size
        args += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if lora is not None:
        env[VLLM_LORA_ENV] = "True"
    return [*args, *extra], env


def engine_line(host: str, port: int) -> str:
    """The ``--set`` value that points a spec's engine at the server."""
    shown = f"[{host}]" if ":" in host else host
    return f"rollout.engine={{name: vllm_server, urls: ['http://{shown}:{port}']}}"


def serve_rollouts_command(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="The spec whose actor to serve."),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a spec value: path=value (repeatable)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback)."),
    port: int = typer.Option(PORT, "--port", min=1, max=65535, help="Port."),
    vllm_args: list[str] = typer.Option(
        [],
        "--vllm-arg",
        help="One more argument for vLLM's server, e.g. --vllm-arg=--max-model-len=2048 "
        "(repeatable).",
    ),
) -> None:
    """Start vLLM's OpenAI-compatible server for SPEC's actor, ready for the vllm_server
    rollout engine, and print the rollout.engine setting that uses it."""
    from ppokit.spec import SpecError, load_spec

    try:
        spec = load_spec(spec_path, overrides)
    except SpecError as exc:
        raise UserError(str(exc)) from None
    if importlib.util.find_spec("vllm") is None:
        raise MissingDependency("vllm", "ppokit serve-rollouts", VLLM_INSTALL)
    folder = Path(tempfile.mkdtemp(prefix="ppokit-serve-rollouts-"))
    try:
        model = _source(spec) or str(write_model(spec, folder / "model"))
        args, env = server_args(spec, model, host, port, vllm_args)
        print(f"serving {spec.model.actor} on http://{host}:{port}; in the spec:", flush=True)
        print(f'  --set "{engine_line(host, port)}"', flush=True)
        proc = subprocess.Popen(args, env=env)
        # SIGTERM goes on to the server, which stops; its model folder is removed below
        signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            code = proc.wait()
            code = 0 if code == -signal.SIGTERM else code
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            code = 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if code:
        raise UserError(f"ppokit serve-rollouts: vLLM's server ended with status {code}")
