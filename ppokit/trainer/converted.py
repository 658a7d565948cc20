"""A model file converted once: the float32 weights and the tokenizer that transformers
dequantizes from a GGUF file (SmolLM2-135M-Instruct's, about 20 s on two cores every time)
kept in ppokit's cache folder as a plain model directory (safetensors and the tokenizer's
JSON files), so that every later load of the same file reads them instead.

The cache folder is ``$PPOKIT_CACHE``, else ``$XDG_CACHE_HOME/ppokit``, else
``~/.cache/ppokit``; ``PPOKIT_CACHE=off`` turns it off. An entry is named by the source
file's name, size and modification time and transformers' version (a changed file or another
transformers converts again); it is written into a temporary folder and renamed into place
whole, so an entry that exists is complete. It is read as any local model directory is: its
remote code never runs and its weights are safetensors (nothing is unpickled). An entry that
cannot be read is converted again; a cache that cannot be written only costs the conversion.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from torch import nn

from ppokit.errors import one_line

__all__ = [
    "CACHE_ENV",
    "cache_root",
    "entry_name",
    "load_converted",
    "one_gguf_parse",
    "without_gguf_marker",
]

#: The environment variable that names the cache folder, or turns it off (``off``).
CACHE_ENV = "PPOKIT_CACHE"
#: The file an entry records its source in (written before the entry is renamed into place).
SOURCE_FILE = "ppokit-source.json"


def cache_root() -> Path | None:
    """The cache folder (see the module's docstring); None when ``PPOKIT_CACHE=off``."""
    raw = os.environ.get(CACHE_ENV, "").strip()
    if raw.lower() in ("off", "0", "false", "no"):
        return None
    if raw:
        return Path(raw).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ppokit"


def entry_name(source: Path) -> str:
    """``NAME-SIZE-MTIME_NS-transformers-VERSION``: what a conversion of ``source`` depends on."""
    import transformers

    stat = source.stat()
    return (
        f"{source.name}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"
    )


def without_gguf_marker(model: Any) -> None:
    """A model read from a GGUF file holds dequantized float tensors but keeps transformers'
    GGUF "quantizer" (and ``config.quantization_config``), which refuses ``save_pretrained``
    and would make a reader look for a GGUF file: drop the marker, keep the weights."""
    config = getattr(model, "config", None)
    quantization = getattr(config, "quantization_config", None)
    quantizer = getattr(model, "hf_quantizer", None)
    for marker in (quantization, getattr(quantizer, "quantization_config", None)):
        method = getattr(marker, "quant_method", None)
        if marker is not None and str(getattr(method, "value", method)) != "gguf":
            return  # another quantization: save_pretrained decides
    if quantizer is not None:
        model.hf_quantizer = None
    if config is not None and quantization is not None:
        config.quantization_config = None
        del config.quantization_config


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """Within the block, a GGUF file is parsed once: transformers parses it again for the
    tokenizer, the config and the weights (a ``gguf.GGUFReader`` each, about 4 s on a CPU for
    SmolLM2's), and here the three share the first reader (its tensors are mapped from the
    file, read-only). Without the ``gguf`` package, nothing changes."""
    try:
        import gguf
    except ImportError:
        yield
        return
    parse = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    class SharedReader(parse):  # type: ignore[misc,valid-type]
        def __new__(cls, path: str | os.PathLike[str], mode: Literal["r", "r+", "c"] = "r") -> Any:
            key = (os.path.realpath(path), mode)
            if key not in readers:
                readers[key] = parse(path, mode)  # not a SharedReader: __init__ runs once
            return readers[key]

    gguf.GGUFReader = SharedReader  # type: ignore[misc]
    try:
        yield
    finally:
        gguf.GGUFReader = parse  # type: ignore[misc]


def _read(entry: Path) -> tuple[Any, nn.Module]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(entry, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        entry, dtype=torch.float32, trust_remote_code=False, use_safetensors=True
    )
    return tokenizer, model


def _write(entry: Path, source: Path, tokenizer: Any, model: nn.Module) -> None:
    """The converted ``tokenizer`` and ``model`` as the entry ``entry``, whole or not at all."""
    tmp = entry.parent / f".{entry.name}.{uuid.uuid4().hex}.tmp"
    try:
        tmp.mkdir(parents=True)
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)  # type: ignore[operator]
        (tmp / SOURCE_FILE).write_text(json.dumps({"source": str(source)}), encoding="utf-8")
        try:
            tmp.rename(entry)
        except OSError:  # another process renamed its own copy into place first
            if not (entry / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_converted(
    source: Path, convert: Callable[[], tuple[Any, nn.Module]], status: Callable[[str], None]
) -> tuple[Any, nn.Module]:
    """(tokenizer, model) of the model file ``source``: from the cache when it holds the
    file's conversion, else ``convert()`` (its GGUF marker dropped), whose result is then
    cached. ``status`` hears which of the two happens."""
    root = cache_root()
    entry = None if root is None else root / entry_name(source)
    if entry is not None and (entry / SOURCE_FILE).is_file():
        status(f"reading its float32 conversion from {entry}")
        try:
            return _read(entry)
        except Exception as exc:  # an unreadable entry: converted again, below
            warnings.warn(
                f"the converted copy in {entry} cannot be read ({one_line(exc)}): converting "
                f"{source.name} again",
                stacklevel=2,
            )
            shutil.rmtree(entry, ignore_errors=True)
    with one_gguf_parse():
        tokenizer, model = loaded = convert()
    without_gguf_marker(model)
    if entry is not None:
        status(f"keeping its float32 conversion in {entry} (once; {CACHE_ENV}=off keeps none)")
        try:
            _write(entry, source, tokenizer, model)
        except OSError as exc:
            warnings.warn(
                f"the float32 conversion of {source.name} cannot be kept in {entry.parent} "
                f"({one_line(exc)}); set {CACHE_ENV} to a writable folder, or to off",
                stacklevel=2,
            )
    return loaded
