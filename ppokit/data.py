"""Prompt sources: where the rows of a run's prompts come from.

``data.source`` in the spec names a component of kind ``prompt_source``
(:mod:`ppokit.components.prompt_source`; a plugin may add one), which gives one of the
streams here, seeded with the run's data seed. The built-ins:

- ``demo``: rows of the built-in demo task (``ppokit.tasks.demo.make_row``);
- ``arithmetic``: generated arithmetic problems with their exact answers
  (``ppokit.tasks.arithmetic.make_row``);
- ``file``, a data file or folder (``data.source`` its path): a ``.jsonl`` file, one JSON
  object per line, read without the ``datasets`` package; any other local data file or
  folder the ``datasets`` package reads (``.json``, ``.parquet``, ``.csv``, ``.arrow``, a
  folder of data files, a folder written by ``Dataset.save_to_disk``), with the ``data``
  extra (``pip install 'ppokit[data]'``);
- ``hf``, a Hub dataset (``data.source`` ``hf:owner/name``, ``data.config``,
  ``data.split``), read by ``datasets``.

A data file's rows are cycled through (reshuffled each epoch when ``data.shuffle``) by one
class, :class:`RowSource`, whichever reader gives the rows, and each goes through
:class:`RowMap`: ``data.columns`` maps ppokit's fields onto the data's columns, a prompt
column of chat messages becomes the last user message (the row keeps the messages under
``"messages"``), and ``data.answer_pattern`` extracts the gold answer.

Each row is a dict with ``"prompt"`` plus every other column (e.g. ``"answer"``), which the
rewards receive as fields. A source is deterministic given its seed, and its
:meth:`~PromptSource.state_dict` (JSON-serialisable) resumes the exact sequence of rows: a
resumed run draws the same rows as an uninterrupted one. Generated rows are a function of
``(seed, row number)`` only, so the state is just the number of rows drawn; a data file's
state also holds its fingerprint, so a changed file is refused on resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import stat
from abc import abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypedDict, TypeVar

from pydantic import BaseModel, ValidationError

from ppokit.components.prompt_source import (
    ArithmeticParams,
    DemoParams,
    GeneratedSource,
    PromptSource,
)
from ppokit.components.reward import RESERVED_FIELDS
from ppokit.errors import MissingDependency, UserError, clipped, one_line
from ppokit.registry import Registry, format_validation_error, get_registry
from ppokit.spec import DataSpec
from ppokit.spec.checks import source_problems

Options = TypeVar("Options", bound=BaseModel)

__all__ = [
    "DATA_FILE_TYPES",
    "ArithmeticSource",
    "DatasetSource",
    "DemoSource",
    "GeneratedSource",
    "JsonlSource",
    "PromptSource",
    "RowMap",
    "RowSettings",
    "RowSource",
    "hash_files",
    "hub_source",
    "load_hub_dataset",
    "load_local_dataset",
    "local_source",
    "make_prompt_source",
]


class DemoSource(GeneratedSource):
    """Rows of the built-in demo task."""

    kind = "demo"

    def __init__(self, seed: int, options: dict[str, Any]) -> None:
        from ppokit.tasks.demo import make_row

        settings = _options(DemoParams, options)
        super().__init__(seed, lambda rng: make_row(rng, settings.symbols, settings.turns))


def _options(model: type[Options], options: dict[str, Any]) -> Options:
    """``options`` validated by the source's options model; a UserError naming each problem."""
    try:
        return model.model_validate(options)
    except ValidationError as err:
        lines = format_validation_error(err, prefix="data.options")
        raise UserError("; ".join(lines).replace("Value error, ", "")) from None


class ArithmeticSource(GeneratedSource):
    """Arithmetic problems over integers in ``[min_value, max_value]`` with ``terms``
    operands and operators drawn from ``ops`` (default ``"+-*"``)."""

    kind = "arithmetic"

    def __init__(self, seed: int, options: dict[str, Any]) -> None:
        from ppokit.tasks.arithmetic import make_row

        settings = _options(ArithmeticParams, options)
        super().__init__(seed, lambda rng: make_row(rng, settings))


# -------------------------------------------------------------------- data rows
def _preview(value: Any, limit: int = 60) -> str:
    return clipped(repr(value), limit)


def _chat_prompt(messages: list[Any], column: str, where: str) -> tuple[str, list[dict[str, Any]]]:
    """(the last user message's content, the messages up to and including it)."""
    last = None
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise UserError(
                f"{where}: {column!r} holds a list whose item {i} is not a chat message "
                "(a mapping with a 'role' and a 'content')"
            )
        if message["role"] == "user":
            last = i
    if last is None:
        raise UserError(f"{where}: the chat messages in {column!r} have no user message")
    content = messages[last].get("content")
    if not isinstance(content, str):
        raise UserError(
            f"{where}: the last user message in {column!r} has no text content "
            f"(got {type(content).__name__})"
        )
    kept = [{k: v for k, v in m.items() if v is not None} for m in messages[: last + 1]]
    return content, kept


class RowMap:
    """How a row of a data file becomes a ppokit row: ``data.columns`` (ppokit's field ->
    the data's column; other columns keep their names), the messages layout (a prompt column
    holding chat messages) and ``data.answer_pattern``."""

    def __init__(
        self, columns: Mapping[str, str] | None = None, answer_pattern: str | None = None
    ) -> None:
        self.columns = dict(columns or {})
        self.answer_pattern = answer_pattern
        self.pattern: re.Pattern[str] | None = None
        if answer_pattern is not None:
            try:
                self.pattern = re.compile(answer_pattern)
            except re.error as exc:
                raise UserError(f"data.answer_pattern: not a regular expression: {exc}") from None
            if self.pattern.groups != 1:
                raise UserError(
                    "data.answer_pattern: needs exactly one capturing group (the answer), "
                    f"got {self.pattern.groups}"
                )
        self._renamed = set(self.columns.values())

    def column(self, name: str) -> str:
        """The data column that ppokit's field ``name`` is read from."""
        return self.columns.get(name, name)

    def required(self) -> dict[str, str]:
        """ppokit field -> data column, for every column the rows must have."""
        needed = {"prompt": self.column("prompt")}
        if self.pattern is not None:
            needed["answer"] = self.column("answer")
        needed.update(self.columns)
        return needed

    def _missing(self, available: Collection[str], noun: str) -> str:
        """The required columns ``available`` lacks, each with its ``data.columns`` entry."""
        out = []
        for name, column in self.required().items():
            if column in available:
                continue
            if name in self.columns:
                hint = f"data.columns.{name}"
            else:
                hint = f"map the {name} to a column with data.columns: {{{name}: <column>}}"
            out.append(noun.format(repr(column)) + f" ({hint})")
        return ", ".join(out)

    def check_columns(self, available: Sequence[str], where: str) -> None:
        """A UserError naming each required column ``available`` lacks, and those it has."""
        missing = self._missing(available, "column {}")
        if missing:
            raise UserError(
                f"{where}: the data has no {missing}; its columns: {', '.join(available) or 'none'}"
            )

    def __call__(self, raw: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The ppokit row of the data row ``raw`` (a fresh dict); ``where`` names the row in
        errors."""
        missing = self._missing(raw, "{} field")
        if missing:
            raise UserError(
                f"{where}: the row has no {missing}; its fields: {', '.join(raw) or 'none'}"
            )
        row = {name: raw[column] for name, column in self.columns.items()}
        for key, value in raw.items():
            if key not in self._renamed and key not in row:
                row[key] = value
        clash = next((key for key in row if key in RESERVED_FIELDS), None)
        if clash is not None:
            raise UserError(
                f"{where}: the column {clash!r} has the name of a field ppokit passes to every "
                f"reward ({', '.join(RESERVED_FIELDS)}): rename it, or map it to another name "
                f"with data.columns: {{<name>: {clash}}}"
            )
        prompt, column = row["prompt"], self.column("prompt")
        if isinstance(prompt, list):
            row["prompt"], row["messages"] = _chat_prompt(prompt, column, where)
        elif not isinstance(prompt, str):
            raise UserError(
                f"{where}: {column!r} must be a string or a list of chat messages, "
                f"got {type(prompt).__name__}"
            )
        if self.pattern is not None:
            answer = row["answer"]
            found = self.pattern.search(str(answer)) if answer is not None else None
            if found is None or found.group(1) is None:
                raise UserError(
                    f"{where}: data.answer_pattern {self.answer_pattern!r} does not match "
                    f"the answer {_preview(answer)} (column {self.column('answer')!r})"
                )
            row["answer"] = found.group(1).strip()
        return row


class RowSource(PromptSource):
    """The rows of a finite table, cycled: each epoch visits every row once, in a fresh
    seeded order when ``shuffle`` (else in the table's order), and each row goes through
    :class:`RowMap`. Subclasses only give the rows (:meth:`raw`); the order, the epochs,
    the state and the fingerprint check are written here once. Every row is converted when
    the source is built, so a bad row is an error before any model is loaded."""

    def __init__(
        self,
        seed: int,
        *,
        size: int,
        fingerprint: str,
        label: str,
        shuffle: bool = True,
        columns: Mapping[str, str] | None = None,
        answer_pattern: str | None = None,
    ) -> None:
        super().__init__(seed)
        self.size = int(size)
        self.fingerprint = fingerprint
        self.label = label
        self.shuffle = shuffle
        self.map = RowMap(columns, answer_pattern)
        self._order_epoch = -1
        self._order: list[int] = []
        if self.size <= 0:
            raise UserError(f"{label}: the data has no rows")
        self.check()

    @abstractmethod
    def raw(self, index: int) -> Mapping[str, Any]:
        """The table's ``index``-th row, as stored (before :class:`RowMap`)."""

    def where(self, index: int) -> str:
        """The table's ``index``-th row, as errors name it."""
        return f"{self.label}: row {index}"

    def check(self) -> None:
        """Convert every row once (a UserError for the first bad one)."""
        for index in range(self.size):
            self.map(self.raw(index), self.where(index))

    def order(self, epoch: int) -> list[int]:
        """Row indices in the order of ``epoch``."""
        if epoch != self._order_epoch:
            order = list(range(self.size))
            if self.shuffle:
                random.Random(f"ppokit:{self.kind}:{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def row(self, index: int) -> dict[str, Any]:
        epoch, offset = divmod(index, self.size)
        i = self.order(epoch)[offset]
        return self.map(self.raw(i), self.where(i))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("source") == self.kind and state.get("fingerprint") != self.fingerprint:
            raise UserError(
                f"{self.label}: the data changed since the checkpoint was written; "
                "the resumed run would not see the same prompts"
            )
        super().load_state_dict(state)
        self._order_epoch = -1


# ----------------------------------------------------------------------- JSONL
_NOT_FOUND = (
    "data.source is a prompt source's name (ppokit list prompt_source), a data file or "
    "folder, or hf:owner/name"
)


#: The largest JSONL file read (it is read whole; larger data: a format ``datasets`` reads,
#: as parquet, which it maps from disk).
MAX_JSONL_BYTES = 2 << 30


def read_data_file(path: Path, limit: int = MAX_JSONL_BYTES) -> bytes:
    """The bytes of the regular file at ``path`` (a link is followed), at most ``limit`` of
    them: a FIFO, a device (a link to ``/dev/zero``) or a socket is refused without waiting
    for it, and a larger file is a UserError, never read whole."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UserError(f"data file not found: {path} ({_NOT_FOUND})") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{path}: not a regular file (a device, a FIFO or a socket)")
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise UserError(
            f"{path}: larger than {limit >> 20} MiB, the most a JSONL file may hold (it is "
            "read whole): write the data as parquet, which is read from disk as needed"
        )
    return data


def _parse_jsonl(text: str, path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of a JSONL file."""
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
        except RecursionError:
            raise UserError(f"{path}:{lineno}: the JSON nests too deeply") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append((lineno, row))
    if not rows:
        raise UserError(f"{path}: the data file has no rows")
    return rows


class JsonlSource(RowSource):
    """The rows of a JSONL file (one JSON object per line), read without the ``datasets``
    package; its fingerprint is a hash of the file's bytes."""

    kind = "jsonl"

    def __init__(
        self,
        seed: int,
        path: str | Path,
        shuffle: bool = True,
        columns: Mapping[str, str] | None = None,
        answer_pattern: str | None = None,
    ) -> None:
        self.path = Path(path)
        data = read_data_file(self.path)
        try:
            text = data.decode("utf-8-sig")  # a byte order mark is no part of the first line
        except UnicodeDecodeError as exc:
            raise UserError(f"{self.path}: cannot read: {exc}") from None
        parsed = _parse_jsonl(text, self.path)
        self.lines = [lineno for lineno, _ in parsed]
        self.rows = [row for _, row in parsed]
        super().__init__(
            seed,
            size=len(self.rows),
            fingerprint=hashlib.sha256(data).hexdigest()[:16],
            label=str(self.path),
            shuffle=shuffle,
            columns=columns,
            answer_pattern=answer_pattern,
        )

    def raw(self, index: int) -> Mapping[str, Any]:
        return self.rows[index]

    def where(self, index: int) -> str:
        return f"{self.path}:{self.lines[index]}"


# -------------------------------------------------------------------- datasets
#: Data file suffixes the ``datasets`` package reads, and its builder for each.
DATA_FILE_TYPES = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
#: Rows read at once when a dataset's rows are checked.
_CHECK_BATCH = 4096


def _import_datasets(source: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise MissingDependency(
            "datasets", f"data.source {source!r}", "pip install 'ppokit[data]'"
        ) from None
    return datasets


def _with_cause(exc: BaseException) -> str:
    """An exception and its cause, each as :func:`~ppokit.errors.one_line`, for one line."""
    cause = exc.__cause__
    return one_line(exc) + (f": {one_line(cause)}" if cause is not None else "")


def _load(datasets: Any, label: str, load: Callable[[], Any]) -> Any:
    """``load()`` with the progress bars of ``datasets`` off; any failure is a UserError."""
    disabled = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        return load()
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{label}: cannot load the dataset: {_with_cause(exc)}") from None
    finally:
        if not disabled:
            datasets.utils.enable_progress_bars()


def _data_files(path: Path) -> list[Path]:
    """The files of a data file or folder (hidden files and folders skipped), sorted."""
    if path.is_file():
        return [path]
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )


def hash_files(path: Path) -> str:
    """A hash of a data file's bytes, or of the names and bytes of a folder's files."""
    digest = hashlib.sha256()
    for file in _data_files(path):
        name = "" if file == path else file.relative_to(path).as_posix()
        digest.update(f"{name}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as f:
            for chunk in iter(partial(f.read, 1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def _file_type(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        suffixes.pop()
    return DATA_FILE_TYPES.get(suffixes[-1]) if suffixes else None


def _select_split(dataset: Any, split: str, label: str) -> Any:
    """The ``split`` of a dataset saved with ``save_to_disk`` (a DatasetDict or a Dataset)."""
    if hasattr(dataset, "keys"):  # a DatasetDict
        if split not in dataset:
            raise UserError(
                f"data.split: {label} has no split {split!r}; its splits: {', '.join(dataset)}"
            )
        return dataset[split]
    if split != "train":
        raise UserError(
            f"data.split: {label} is a single saved Dataset, without splits; "
            f"leave data.split at 'train' (got {split!r})"
        )
    return dataset


def load_local_dataset(path: Path, split: str = "train") -> tuple[Any, str]:
    """(``datasets.Dataset``, fingerprint) of a local data file or folder: a folder written by
    ``save_to_disk`` is read with ``load_from_disk``, a folder of data files or a data file
    with ``load_dataset`` (its ``split``). The fingerprint hashes the files' bytes."""
    label = str(path)
    if path.is_dir():
        datasets = _import_datasets(label)
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            saved = _load(datasets, label, lambda: datasets.load_from_disk(str(path)))
            dataset = _select_split(saved, split, label)
        else:
            dataset = _load(datasets, label, lambda: datasets.load_dataset(str(path), split=split))
    else:
        builder = _file_type(path)
        if builder is None:
            raise UserError(
                f"{path}: not a data file ppokit reads (.jsonl, .json, .parquet, .csv, .arrow, "
                "optionally compressed) nor a folder"
            )
        datasets = _import_datasets(label)
        dataset = _load(
            datasets,
            label,
            lambda: datasets.load_dataset(builder, data_files=str(path), split=split),
        )
    return dataset, hash_files(path)


def load_hub_dataset(name: str, config: str | None = None, split: str = "train") -> Any:
    """The ``datasets.Dataset`` of a Hub dataset (from the local cache when offline)."""
    source = f"hf:{name}"
    datasets = _import_datasets(source)
    return _load(
        datasets,
        _hub_label(name, config, split),
        lambda: datasets.load_dataset(name, config, split=split),
    )


def _hub_label(name: str, config: str | None, split: str) -> str:
    return f"hf:{name} ({config + ', ' if config else ''}{split})"


class DatasetSource(RowSource):
    """The rows of a ``datasets.Dataset`` (a local data file or folder, or a Hub dataset).

    The fingerprint names the data a state was written for: a hash of the local files'
    bytes, or the Hub dataset's ``_fingerprint``.
    """

    kind = "dataset"

    def __init__(
        self,
        seed: int,
        dataset: Any,
        *,
        fingerprint: str,
        label: str,
        shuffle: bool = True,
        columns: Mapping[str, str] | None = None,
        answer_pattern: str | None = None,
    ) -> None:
        self.dataset = dataset.with_format(None)
        super().__init__(
            seed,
            size=len(dataset),
            fingerprint=fingerprint,
            label=label,
            shuffle=shuffle,
            columns=columns,
            answer_pattern=answer_pattern,
        )

    def raw(self, index: int) -> Mapping[str, Any]:
        return self.dataset[index]

    def check(self) -> None:
        """The columns first (one error naming every missing one), then every row, read in
        batches of the columns the rows need."""
        self.map.check_columns(list(self.dataset.column_names), self.label)
        needed = sorted(set(self.map.required().values()))
        start = 0
        for batch in self.dataset.select_columns(needed).iter(batch_size=_CHECK_BATCH):
            count = len(batch[needed[0]])
            for offset in range(count):
                raw = {name: batch[name][offset] for name in needed}
                self.map(raw, self.where(start + offset))
            start += count


# ---------------------------------------------------------------------- factory
class RowSettings(TypedDict):
    """The settings that every table's source takes (a data file's, a Hub dataset's)."""

    shuffle: bool
    columns: Mapping[str, str] | None
    answer_pattern: str | None


def hub_source(
    seed: int, name: str, config: str | None, split: str, rows: RowSettings
) -> PromptSource:
    """The rows of the Hub dataset ``name`` (``hf:name``), seeded with ``seed``."""
    dataset = load_hub_dataset(name, config, split)
    label = _hub_label(name, config, split)
    return DatasetSource(seed, dataset, fingerprint=dataset._fingerprint, label=label, **rows)


def local_source(seed: int, source: str, split: str, rows: RowSettings) -> PromptSource:
    """The rows of the local data file or folder ``source``, seeded with ``seed``: a
    ``.jsonl`` file read by :class:`JsonlSource`, anything else by ``datasets``."""
    path = Path(source).expanduser()
    if path.suffix.lower() == ".jsonl" and not path.is_dir():
        if split != "train":
            raise UserError(
                f"data.split: a JSONL file is read whole; leave data.split at 'train' "
                f"(got {split!r})"
            )
        return JsonlSource(seed, path, **rows)
    if path.exists() and not (path.is_dir() or stat.S_ISREG(path.stat().st_mode)):
        raise UserError(f"{path}: not a regular file (a device, a FIFO or a socket)")
    if not path.exists():
        hint = ""
        if re.fullmatch(r"[\w.-]+/[\w.-]+", source) and not path.suffix:
            hint = f"; for a Hub dataset write hf:{source}"
        raise UserError(f"data file not found: {path} ({_NOT_FOUND}){hint}")
    dataset, fingerprint = load_local_dataset(path, split)
    return DatasetSource(seed, dataset, fingerprint=fingerprint, label=str(path), **rows)


def make_prompt_source(
    data_spec: DataSpec, seed: int, registry: Registry | None = None
) -> PromptSource:
    """The stream of the prompt source ``data_spec.source`` names (a component of kind
    ``prompt_source``: :meth:`DataSpec.prompt_source`), seeded with ``seed``.

    A data file or dataset is read, and each of its rows checked, here: a missing column, a
    bad row or a missing ``datasets`` package is a UserError before any model is loaded.
    """
    registry = registry or get_registry()
    problems = source_problems(data_spec, "data", registry)
    if problems:
        raise UserError("; ".join(problems).replace("Value error, ", ""))
    comp = data_spec.prompt_source(registry)
    info = registry.info("prompt_source", comp.name)
    model = info.validate(comp.params)  # valid: source_problems said so
    values = {k: getattr(model, k) for k in type(model).model_fields}
    stream = info.load()(**values)(seed)
    if not isinstance(stream, PromptSource):
        raise UserError(
            f"data.source: prompt_source {comp.name!r} gave a {type(stream).__name__}, not a "
            "ppokit.data.PromptSource"
        )
    return stream
