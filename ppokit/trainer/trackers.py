"""Experiment trackers: ``output.report_to: [tensorboard, wandb, mlflow]``.

Each tracker receives every metric of every round (training and ``eval/...``), the spec,
sample completions and the curves image, through its own library:

- ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` writing to ``OUT/tensorboard``
  (scalars, the spec and samples as text, the curves as an image);
- ``wandb``: ``wandb.init(project="ppokit", dir=OUT, mode=$WANDB_MODE or "online")``
  (history keyed on the ``round`` metric, the spec as the run's config, samples as a
  ``wandb.Table``, the curves as a ``wandb.Image``);
- ``mlflow``: an ``MlflowClient`` on ``$MLFLOW_TRACKING_URI``, else on a local file store
  ``OUT/mlruns`` (metrics with ``step = round``, the spec as parameters and as
  ``spec.yaml``, samples with ``log_table``, the curves as an artifact), experiment
  ``ppokit``.

``metrics.jsonl`` stays the record of a run and is written whatever the trackers do. A
tracker that fails (when it starts or while logging) is reported once, on one line of
stderr, and disabled; the run goes on. A tracker whose package is not installed is a
:class:`~ppokit.errors.MissingDependency` when :class:`Trackers` is built (the spec already
refuses it when it is validated).

Resuming continues the same tracker run: tensorboard writes to the same log directory (with
``purge_step`` so the rounds re-run after the checkpoint replace the ones logged before the
interruption), and the wandb run id and the mlflow run id are kept in ``OUT/trackers.json``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
import secrets
import string
import sys
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ppokit.errors import MissingDependency, one_line
from ppokit.metrics_table import ROUND
from ppokit.runfolder import TRACKER_FILES, TRACKERS_JSON, read_json, write_atomic

if TYPE_CHECKING:
    from ppokit.spec import Spec

__all__ = [
    "IDS_FILE",
    "TRACKER_FILES",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "Trackers",
    "WandbTracker",
    "numeric_metrics",
]

#: Where the trackers' run ids are kept, in the run folder.
IDS_FILE = TRACKERS_JSON
#: Sample completions sent per call (as many as ``samples.jsonl`` keeps).
SAMPLE_LIMIT = 8


def numeric_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record (None, NaN, text and booleans left out)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(float(value)):
            out[str(key)] = float(value)
    return out


def _flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """``{"train.actor_lr": "0.0005", ...}``: a nested mapping's leaves as strings."""
    out: dict[str, str] = {}
    if isinstance(data, Mapping) and data:
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    else:
        out[prefix or "value"] = json.dumps(data) if not isinstance(data, str) else data
    return out


def _import(package: str, module: str | None = None) -> Any:
    """``module`` (default ``package``), or MissingDependency naming the extra to install."""
    try:
        return importlib.import_module(module or package)
    except ImportError as exc:
        raise MissingDependency(
            package, f"output.report_to: {package}", f"pip install 'ppokit[{package}]'"
        ) from exc


class _Ids:
    """The trackers' run ids in ``OUT/trackers.json`` (read and written whole)."""

    def __init__(self, out: Path) -> None:
        self.path = out / IDS_FILE

    def read(self) -> dict[str, Any]:
        try:
            data = read_json(self.path)
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, name: str) -> dict[str, Any]:
        entry = self.read().get(name)
        return entry if isinstance(entry, dict) else {}

    def set(self, name: str, entry: dict[str, Any]) -> None:
        data = self.read()
        data[name] = entry
        write_atomic(self.path, json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------- trackers
class Tracker(ABC):
    """One tracker; every method may raise (:class:`Trackers` disables it then)."""

    name: str = ""

    @abstractmethod
    def start(self, spec_data: dict[str, Any], spec_yaml: str) -> None:
        """Open (or resume) the tracker's run and record the spec."""

    @abstractmethod
    def log_metrics(self, round_no: int, metrics: dict[str, float]) -> None: ...

    @abstractmethod
    def log_samples(self, round_no: int, rows: list[tuple[str, str, float]]) -> None: ...

    @abstractmethod
    def log_image(self, round_no: int, path: Path) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def _markdown_table(rows: Sequence[tuple[str, str, float]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| prompt | response | reward |", "|---|---|---|"]
    lines += [f"| {cell(p)} | {cell(r)} | {s:.4g} |" for p, r, s in rows]
    return "\n".join(lines)


class TensorBoardTracker(Tracker):
    """``SummaryWriter(OUT/tensorboard)``: scalars, text (spec, samples), the curves image."""

    name = "tensorboard"

    def __init__(self, out: Path, start_round: int = 0) -> None:
        _import("tensorboard")
        self._writer_cls = _import("tensorboard", "torch.utils.tensorboard").SummaryWriter
        self.log_dir = out / "tensorboard"
        self.start_round = start_round
        self.writer: Any = None

    def start(self, spec_data: dict[str, Any], spec_yaml: str) -> None:
        # purge_step: the rounds after the checkpoint are logged again on resume; the
        # events written for them before the interruption are hidden
        purge = self.start_round + 1 if self.start_round > 0 else None
        self.writer = self._writer_cls(log_dir=str(self.log_dir), purge_step=purge)
        indented = "\n".join("    " + line for line in spec_yaml.splitlines())
        self.writer.add_text("spec", indented, global_step=self.start_round)
        self.writer.flush()

    def log_metrics(self, round_no: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=round_no)
        self.writer.flush()

    def log_samples(self, round_no: int, rows: list[tuple[str, str, float]]) -> None:
        self.writer.add_text("samples", _markdown_table(rows), global_step=round_no)
        self.writer.flush()

    def log_image(self, round_no: int, path: Path) -> None:
        from matplotlib.image import imread

        image = imread(str(path))  # float32 [H, W, C] in [0, 1] for a PNG
        if image.ndim == 3 and image.shape[2] == 4:
            image = image[..., :3]
        self.writer.add_image("curves", image, global_step=round_no, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbTracker(Tracker):
    """A wandb run in project ``ppokit`` under ``OUT/wandb``, resumed by its stored id."""

    name = "wandb"

    def __init__(self, out: Path, run_name: str) -> None:
        self.wandb = _import("wandb")
        self.out = out
        self.run_name = run_name
        self.ids = _Ids(out)
        self.run: Any = None

    def start(self, spec_data: dict[str, Any], spec_yaml: str) -> None:
        wandb = self.wandb
        stored = self.ids.get(self.name).get("id")
        run_id = stored if isinstance(stored, str) and stored else _new_id()
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "ppokit"),
            dir=str(self.out),
            mode=os.environ.get("WANDB_MODE", "online"),
            id=run_id,
            resume="allow",
            name=self.run_name,
            reinit="create_new" if _wandb_new_reinit(wandb) else True,
            settings=wandb.Settings(console="off", silent=True),
        )
        self.ids.set(self.name, {"id": run_id})
        self.run.config.update(spec_data, allow_val_change=True)
        self.run.define_metric(ROUND)
        self.run.define_metric("*", step_metric=ROUND)

    def log_metrics(self, round_no: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, ROUND: round_no})

    def log_samples(self, round_no: int, rows: list[tuple[str, str, float]]) -> None:
        table = self.wandb.Table(
            columns=[ROUND, "prompt", "response", "reward"],
            data=[[round_no, p, r, s] for p, r, s in rows],
        )
        self.run.log({"samples": table, ROUND: round_no})

    def log_image(self, round_no: int, path: Path) -> None:
        self.run.log({"curves": self.wandb.Image(str(path)), ROUND: round_no})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _new_id() -> str:
    """A new wandb run id: 8 lowercase letters and digits (as wandb makes them)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _wandb_new_reinit(wandb: Any) -> bool:
    """Whether this wandb takes ``reinit="create_new"`` (0.19.10 and later)."""
    try:
        major, minor, patch = (int(x) for x in re.findall(r"\d+", wandb.__version__)[:3])
    except (ValueError, AttributeError):
        return False
    return (major, minor, patch) >= (0, 19, 10)


#: Characters mlflow accepts in a metric or parameter name.
_MLFLOW_NAME = re.compile(r"[^\w./\- :]")
#: mlflow's limits: parameters per call, characters of a parameter's value.
_MLFLOW_PARAMS_PER_CALL = 100
_MLFLOW_PARAM_CHARS = 500


def mlflow_key(key: str) -> str:
    """A metric name mlflow accepts: ``eval/pass@4`` -> ``eval/pass_at_4``."""
    return _MLFLOW_NAME.sub("_", key.replace("@", "_at_"))


class MLflowTracker(Tracker):
    """An mlflow run in experiment ``ppokit``, resumed by its stored run id."""

    name = "mlflow"

    def __init__(self, out: Path, run_name: str) -> None:
        _import("mlflow")
        self._client_cls = _import("mlflow", "mlflow.tracking").MlflowClient
        self._entities = _import("mlflow", "mlflow.entities")
        self.out = out
        self.run_name = run_name
        self.ids = _Ids(out)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.local = not uri
        if not uri:
            # mlflow 3 keeps its file store for those who ask for it: this one does
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri or (out / "mlruns").resolve().as_uri()
        self.client: Any = None
        self.run_id: str | None = None

    def _resumable(self, stored: dict[str, Any]) -> str | None:
        run_id = stored.get("run_id")
        if not isinstance(run_id, str) or stored.get("tracking_uri") != self.tracking_uri:
            return None
        try:
            self.client.get_run(run_id)
        except Exception:
            return None  # deleted, or another store: start a new run
        return run_id

    def start(self, spec_data: dict[str, Any], spec_yaml: str) -> None:
        if self.local and not (self.out / "mlruns").is_dir():
            # a new store laid out on disk (mlflow keeps the store of a URI it has used in
            # this process, which would not recreate a folder an --overwrite removed)
            _import("mlflow", "mlflow.store.tracking.file_store").FileStore(self.tracking_uri)
        self.client = self._client_cls(tracking_uri=self.tracking_uri)
        run_id = self._resumable(self.ids.get(self.name))
        if run_id is None:
            experiment = self.client.get_experiment_by_name("ppokit")
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment("ppokit")
            )
            run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
            self.ids.set(self.name, {"run_id": run_id, "tracking_uri": self.tracking_uri})
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        # parameters cannot change once logged: on resume only new ones are added (the
        # spec.yaml artifact is the current spec)
        logged = self.client.get_run(run_id).data.params
        params = [
            self._entities.Param(mlflow_key(k)[:250], v[:_MLFLOW_PARAM_CHARS])
            for k, v in _flatten(spec_data).items()
            if mlflow_key(k)[:250] not in logged
        ]
        for i in range(0, len(params), _MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(run_id, params=params[i : i + _MLFLOW_PARAMS_PER_CALL])
        self.client.log_text(run_id, spec_yaml, "spec.yaml")

    def log_metrics(self, round_no: int, metrics: dict[str, float]) -> None:
        stamp = int(time.time() * 1000)
        entries = [
            self._entities.Metric(mlflow_key(k), v, stamp, round_no) for k, v in metrics.items()
        ]
        for i in range(0, len(entries), 1000):
            self.client.log_batch(self.run_id, metrics=entries[i : i + 1000])

    def log_samples(self, round_no: int, rows: list[tuple[str, str, float]]) -> None:
        data = {
            ROUND: [round_no] * len(rows),
            "prompt": [p for p, _, _ in rows],
            "response": [r for _, r, _ in rows],
            "reward": [s for _, _, s in rows],
        }
        with warnings.catch_warnings():  # pandas deprecations inside mlflow's log_table
            warnings.simplefilter("ignore")
            self.client.log_table(self.run_id, data, f"samples/round_{round_no:06d}.json")

    def log_image(self, round_no: int, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FINISHED")
            self.run_id = None


# --------------------------------------------------------------------------- all of them
class Trackers:
    """The trackers of ``spec.output.report_to`` for the run in ``out_dir``.

    ``log_metrics(round, record)`` sends a metrics record (its finite numbers),
    ``log_samples(round, prompts, responses, scores)`` sample completions,
    ``log_image(path)`` the curves image (at the last round logged), ``close()`` ends the
    trackers' runs. ``start_round``: the rounds already done when the run resumes.
    ``stream``: where the one-line failure reports go (default stderr).
    """

    def __init__(
        self,
        spec: Spec,
        out_dir: str | Path,
        *,
        start_round: int = 0,
        stream: IO[str] | None = None,
    ) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.stream = stream
        self.last_round = start_round
        run_name = out.resolve().name or "ppokit"
        builders: dict[str, Callable[[], Tracker]] = {
            "tensorboard": lambda: TensorBoardTracker(out, start_round),
            "wandb": lambda: WandbTracker(out, run_name),
            "mlflow": lambda: MLflowTracker(out, run_name),
        }
        names = list(dict.fromkeys(spec.output.report_to))
        built = [builders[name]() for name in names]  # MissingDependency before any starts
        self.trackers: list[Tracker] = []
        spec_data = spec.model_dump(mode="json")
        spec_yaml = spec.to_yaml()
        for tracker in built:
            if self._call(tracker, "start", spec_data, spec_yaml, started=False):
                self.trackers.append(tracker)

    @property
    def names(self) -> list[str]:
        """The trackers still working."""
        return [t.name for t in self.trackers]

    def _report(self, tracker: Tracker, exc: BaseException, started: bool) -> None:
        what = "failed" if started else "could not start"
        print(
            f"ppokit: tracker {tracker.name} {what} ({one_line(exc)}); it is disabled, "
            "metrics.jsonl is still written",
            file=self.stream or sys.stderr,
            flush=True,
        )

    def _call(self, tracker: Tracker, method: str, *args: Any, started: bool = True) -> bool:
        try:
            getattr(tracker, method)(*args)
        except Exception as exc:
            self._report(tracker, exc, started)
            if tracker in self.trackers:
                self.trackers.remove(tracker)
            if method != "close":
                with contextlib.suppress(Exception):
                    tracker.close()
            return False
        return True

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, method, *args)

    def log_metrics(self, round_no: int, record: Mapping[str, Any]) -> None:
        self.last_round = max(self.last_round, int(round_no))
        metrics = {k: v for k, v in numeric_metrics(record).items() if k != ROUND}
        if metrics:
            self._each("log_metrics", int(round_no), metrics)

    def log_samples(
        self,
        round_no: int,
        prompts: Sequence[str],
        responses: Sequence[str],
        scores: Sequence[float],
        limit: int = SAMPLE_LIMIT,
    ) -> None:
        rows = [
            (str(p), str(r), float(s))
            for p, r, s in list(zip(prompts, responses, scores, strict=True))[:limit]
        ]
        if rows:
            self._each("log_samples", int(round_no), rows)

    def log_image(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_file():
            self._each("log_image", self.last_round, path)

    def close(self) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, "close")
        self.trackers = []

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
