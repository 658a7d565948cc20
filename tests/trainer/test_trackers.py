"""Experiment trackers: what tensorboard, mlflow and wandb (offline) hold after a run's
metrics, samples and curves went through :class:`Trackers`, resuming the same tracker run,
and a failing tracker reported once and disabled."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ppokit.errors import MissingDependency
from ppokit.trainer import loop
from ppokit.trainer.trackers import IDS_FILE, Trackers, mlflow_key, numeric_metrics
from tests.helpers.trainer import small_spec

RECORDS = [
    {"round": r, "reward_mean": 0.25 * r, "kl": None, "entropy": float("nan"), "note": "x"}
    for r in (1, 2, 3)
]
RECORDS[2].update({"eval/accuracy": 0.5, "eval/pass@3": 0.75})


def _spec(tmp: Path, *trackers: str) -> Any:
    return small_spec(tmp, f"output.report_to=[{', '.join(trackers)}]")


def _curves(tmp: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = tmp / "curves.png"
    fig = plt.figure(figsize=(2, 1))
    plt.plot([1, 2, 3], [0.1, 0.5, 0.9])
    fig.savefig(path)
    plt.close(fig)
    return path


def _log_all(trackers: Trackers, tmp: Path, records: list[dict] = RECORDS) -> None:
    for record in records:
        trackers.log_metrics(record["round"], record)
    trackers.log_samples(3, ["echo a", "echo b"], ["aaaa", "bxbb"], [1.0, 0.75])
    trackers.log_image(_curves(tmp))


def test_numeric_metrics_and_mlflow_names() -> None:
    assert numeric_metrics(RECORDS[2]) == {
        "round": 3.0,
        "reward_mean": 0.75,
        "eval/accuracy": 0.5,
        "eval/pass@3": 0.75,
    }
    assert numeric_metrics({"flag": True}) == {}
    assert mlflow_key("eval/pass@3") == "eval/pass_at_3"
    assert mlflow_key("reward/math verify") == "reward/math verify"


# --------------------------------------------------------------------------- tensorboard
def _needs(package: str) -> None:
    """Skip where the tracker's package is not installed (pip install 'ppokit[PACKAGE]')."""
    pytest.importorskip(package)


def _scalars(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_event_files_hold_the_metrics(tmp_path) -> None:
    _needs("tensorboard")
    with Trackers(_spec(tmp_path, "tensorboard"), tmp_path) as trackers:
        assert trackers.names == ["tensorboard"]
        _log_all(trackers, tmp_path)
    acc = _scalars(tmp_path / "tensorboard")
    tags = acc.Tags()
    assert {"reward_mean", "eval/accuracy", "eval/pass@3"} <= set(tags["scalars"])
    assert "kl" not in tags["scalars"] and "entropy" not in tags["scalars"]  # None, NaN
    assert "round" not in tags["scalars"]
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.75),
    ]
    assert [(e.step, e.value) for e in acc.Scalars("eval/pass@3")] == [(3, 0.75)]
    assert "curves" in tags["images"]
    text = {t for t in tags["tensors"]}
    assert any(t.startswith("spec") for t in text) and any(t.startswith("samples") for t in text)


def test_tensorboard_resume_replaces_the_rounds_after_the_checkpoint(tmp_path) -> None:
    _needs("tensorboard")
    with Trackers(_spec(tmp_path, "tensorboard"), tmp_path) as trackers:
        for r in (1, 2, 3, 4):  # rounds 3 and 4 are lost: the checkpoint is at round 2
            trackers.log_metrics(r, {"reward_mean": float(r)})
    with Trackers(_spec(tmp_path, "tensorboard"), tmp_path, start_round=2) as trackers:
        for r in (3, 4):
            trackers.log_metrics(r, {"reward_mean": 10.0 * r})
    events = _scalars(tmp_path / "tensorboard").Scalars("reward_mean")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


# --------------------------------------------------------------------------- mlflow
@pytest.fixture
def mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # restored after the test


def test_mlflow_local_store_holds_the_run(tmp_path, mlflow_env) -> None:
    from mlflow.tracking import MlflowClient

    spec = _spec(tmp_path, "mlflow")
    with Trackers(spec, tmp_path) as trackers:
        assert trackers.names == ["mlflow"]
        _log_all(trackers, tmp_path)
    run_id = json.loads((tmp_path / IDS_FILE).read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.experiment_id == client.get_experiment_by_name("ppokit").experiment_id
    history = client.get_metric_history(run_id, "reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/pass_at_3")] == [
        (3, 0.75)
    ]
    assert "kl" not in run.data.metrics
    assert run.data.params["train.rounds"] == "1"
    assert run.data.params["advantage.name"] == "gae"
    assert run.data.params["advantage.lam"] == "0.95"
    assert run.data.params["reward"] == '["demo"]'
    assert run.data.params["output.report_to"] == '["mlflow"]'
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"spec.yaml", "curves.png", "samples"} <= artifacts
    samples = [a.path for a in client.list_artifacts(run_id, "samples")]
    assert samples == ["samples/round_000003.json"]

    # resume: the same mlflow run goes on, with a spec that changed (more rounds)
    resumed = small_spec(tmp_path, "output.report_to=[mlflow]", "train.rounds=5")
    with Trackers(resumed, tmp_path, start_round=3) as trackers:
        trackers.log_metrics(4, {"reward_mean": 1.0})
    assert json.loads((tmp_path / IDS_FILE).read_text())["mlflow"]["run_id"] == run_id
    steps = sorted(m.step for m in client.get_metric_history(run_id, "reward_mean"))
    assert steps == [1, 2, 3, 4]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_mlflow_local_store_removed_and_made_again_in_one_process(tmp_path, mlflow_env) -> None:
    import shutil

    from mlflow.tracking import MlflowClient

    for _ in range(2):  # as --overwrite does between two runs of one process
        with Trackers(_spec(tmp_path, "mlflow"), tmp_path) as trackers:
            assert trackers.names == ["mlflow"]
            trackers.log_metrics(1, {"reward_mean": 0.5})
        run_id = json.loads((tmp_path / IDS_FILE).read_text())["mlflow"]["run_id"]
        client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
        assert client.get_run(run_id).data.metrics["reward_mean"] == 0.5
        shutil.rmtree(tmp_path / "mlruns")
        (tmp_path / IDS_FILE).unlink()


def test_mlflow_tracking_uri_from_the_environment(tmp_path, monkeypatch, mlflow_env) -> None:
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "server-store").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    with Trackers(_spec(out, "mlflow"), out) as trackers:
        trackers.log_metrics(1, {"reward_mean": 0.5})
    assert not (out / "mlruns").exists()
    run_id = json.loads((out / IDS_FILE).read_text())["mlflow"]["run_id"]
    assert MlflowClient(tracking_uri=store).get_run(run_id).data.metrics["reward_mean"] == 0.5


# --------------------------------------------------------------------------- wandb
@pytest.mark.slow
def test_wandb_offline_writes_its_run_folder_and_resumes_it(tmp_path, monkeypatch) -> None:
    _needs("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Trackers(_spec(tmp_path, "wandb"), tmp_path) as trackers:
        assert trackers.names == ["wandb"]
        _log_all(trackers, tmp_path)
    run_id = json.loads((tmp_path / IDS_FILE).read_text())["wandb"]["id"]
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 1 and folders[0].name.endswith(f"-{run_id}")
    # wandb's service may write the run's log a moment after finish() returns
    log = folders[0] / f"run-{run_id}.wandb"
    keys = (b"reward_mean", b"eval/pass@3", b"actor_lr")
    deadline = time.monotonic() + 30
    while not all(k in log.read_bytes() for k in keys) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(k in log.read_bytes() for k in keys)
    media = {p.parent.name for p in (folders[0] / "files" / "media").rglob("*") if p.is_file()}
    assert {"table", "images"} <= media

    with Trackers(_spec(tmp_path, "wandb"), tmp_path, start_round=3) as trackers:
        trackers.log_metrics(4, {"reward_mean": 1.0})
    assert json.loads((tmp_path / IDS_FILE).read_text())["wandb"]["id"] == run_id
    assert all(f.name.endswith(f"-{run_id}") for f in (tmp_path / "wandb").glob("offline-run-*"))


# --------------------------------------------------------------------------- failures
def test_a_failing_tracker_is_reported_once_and_disabled(tmp_path, monkeypatch) -> None:
    _needs("tensorboard")
    stream = io.StringIO()
    trackers = Trackers(_spec(tmp_path, "tensorboard"), tmp_path, stream=stream)
    writer = trackers.trackers[0].writer  # type: ignore[attr-defined]

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full\nsecond line")

    monkeypatch.setattr(writer, "add_scalar", broken)
    trackers.log_metrics(1, {"reward_mean": 0.5})
    trackers.log_metrics(2, {"reward_mean": 0.6})
    trackers.log_samples(2, ["p"], ["r"], [1.0])
    trackers.log_image(_curves(tmp_path))
    trackers.close()
    lines = stream.getvalue().splitlines()
    assert lines == [
        "ppokit: tracker tensorboard failed (OSError: disk full second line); it is disabled, "
        "metrics.jsonl is still written"
    ]
    assert trackers.names == []


def test_a_tracker_that_cannot_start_is_disabled_and_the_others_go_on(
    tmp_path, monkeypatch, mlflow_env
) -> None:
    _needs("tensorboard")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    stream = io.StringIO()
    with Trackers(_spec(tmp_path, "mlflow", "tensorboard"), tmp_path, stream=stream) as trackers:
        assert trackers.names == ["tensorboard"]
        trackers.log_metrics(1, {"reward_mean": 0.5})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ppokit: tracker mlflow could not start (")
    assert [e.step for e in _scalars(tmp_path / "tensorboard").Scalars("reward_mean")] == [1]


@pytest.mark.parametrize("package", ["wandb", "mlflow", "tensorboard"])
def test_a_missing_package_is_a_missing_dependency(tmp_path, monkeypatch, package) -> None:
    spec = small_spec(tmp_path)
    spec.output.report_to = [package]  # (validate_spec would refuse it where it is missing)
    monkeypatch.setitem(sys.modules, package, None)  # import fails
    with pytest.raises(MissingDependency, match=rf"pip install 'ppokit\[{package}\]'"):
        Trackers(spec, tmp_path)
    assert not (tmp_path / IDS_FILE).exists()


# --------------------------------------------------------------------------- a run
@pytest.mark.slow
def test_a_short_run_reports_to_tensorboard(tmp_path) -> None:
    _needs("tensorboard")
    out = tmp_path / "run"
    loop.train(small_spec(out, "output.report_to=[tensorboard]", "train.rounds=2"))
    acc = _scalars(out / "tensorboard")
    assert [e.step for e in acc.Scalars("reward_mean")] == [1, 2]
    assert "curves" in acc.Tags()["images"]
