"""``ppokit eval``: evaluate a model or a run's latest checkpoint on the spec's held-out
prompts, without training. The evaluation itself (its prompts, seeds and metrics) is
:mod:`ppokit.trainer.evaluation`; this module resolves what to evaluate (a run folder, a
model directory, ``tiny``, ``smollm2-135m-instruct``) and the spec, and prints the result.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ppokit.errors import UserError, error_lines, fail, one_line
from ppokit.registry import RegistryError
from ppokit.spec import (
    DEMO_SOURCE,
    Spec,
    SpecError,
    apply_overrides,
    compose,
    read_demo_spec,
    spec_mapping,
    validate_spec,
)

if TYPE_CHECKING:
    from ppokit.trainer.models import Models

__all__ = ["EvalTarget", "eval_command", "evaluate", "load_models", "load_target"]


class EvalTarget:
    """What ``ppokit eval`` evaluates: a spec and where the actor's weights come from."""

    def __init__(
        self, spec: Spec, kind: str, label: str, checkpoint: Path | None, round_no: int | None
    ) -> None:
        self.spec = spec
        self.kind = kind  # "run" or "model"
        self.label = label
        self.checkpoint = checkpoint
        self.round = round_no


def _is_run_folder(path: Path) -> bool:
    from ppokit.runfolder import has_checkpoint

    if not path.is_dir() or (path / "config.json").is_file():
        return False
    return has_checkpoint(path) or (path / "spec.yaml").is_file()


def _composed(data: dict[str, Any], source: str | None) -> dict[str, Any]:
    """A spec's mapping with its variant and task merged in (:func:`ppokit.spec.compose`)."""
    try:
        return compose(data).data
    except SpecError as exc:
        raise SpecError(exc.errors, source=source) from None


def _finish_spec(data: dict[str, Any], overrides: list[str], source: str | None) -> Spec:
    """Overrides, then an eval section on the training data when the spec has none."""
    try:
        data = apply_overrides(data, overrides)
        if data.get("eval") is None:
            data["eval"] = {"data": copy.deepcopy(data.get("data") or {})}
        return validate_spec(data)
    except SpecError as exc:
        raise SpecError(exc.errors, source=source) from None


def load_target(
    target: str,
    spec_path: str | Path | None = None,
    overrides: list[str] | None = None,
    trust_remote_code: bool = False,
) -> EvalTarget:
    """Resolve ``MODEL_OR_RUN`` and the spec.

    - a run folder (``checkpoint/`` and ``spec.yaml``): its verified checkpoint's actor;
      the spec is ``spec_path`` (default: the run's), with the run's ``model`` section and
      ``seed`` (its architecture, and the seed its evaluations used);
    - ``tiny``, ``smollm2-135m-instruct``, or a Hugging Face model directory (an exported
      model): that actor; the spec is ``spec_path`` (default: the packaged demo spec) with
      ``model.actor`` set to it.

    ``overrides`` (``path=value``) come last. A spec without an eval section gets one on its
    training data (the defaults of ``eval``). A run whose spec sets
    ``model.trust_remote_code`` is refused unless ``trust_remote_code`` (the command line's
    ``--trust-remote-code``): a run folder names no code that runs by itself.
    """
    from ppokit.trainer.checkpoint.layout import state_of
    from ppokit.trainer.checkpoint.read import locate
    from ppokit.trainer.models import SMOLLM2

    overrides = list(overrides or [])
    source = str(spec_path) if spec_path is not None else None
    base = _composed(spec_mapping(spec_path), source) if spec_path is not None else None
    path = Path(target).expanduser()
    if _is_run_folder(path):
        from ppokit.runfolder import has_checkpoint, read_run_spec

        if not has_checkpoint(path):
            raise UserError(f"{path}: the run has no checkpoint yet: nothing to evaluate")
        folder = locate(path)  # every checksum verified
        round_no = int(state_of(folder)["round"])
        run_data = read_run_spec(folder, trust_remote_code=trust_remote_code)
        data = copy.deepcopy(base) if base is not None else copy.deepcopy(run_data)
        data["model"] = copy.deepcopy(run_data.get("model") or {})
        data["seed"] = run_data.get("seed", 0)
        spec = _finish_spec(data, overrides, source or str(folder / "spec.yaml"))
        return EvalTarget(spec, "run", str(path), folder, round_no)
    if target in ("tiny", SMOLLM2) or (path.is_dir() and (path / "config.json").is_file()):
        data = copy.deepcopy(base) if base is not None else _composed(read_demo_spec(), DEMO_SOURCE)
        model = dict(data.get("model") or {})
        model["actor"] = target if target in ("tiny", SMOLLM2) else str(path)
        data["model"] = model
        spec = _finish_spec(data, overrides, source or DEMO_SOURCE)
        return EvalTarget(spec, "model", target, None, None)
    if path.exists():
        raise UserError(
            f"{target}: neither a run folder (checkpoint/ and spec.yaml) nor a model "
            "directory (config.json)"
        )
    raise UserError(
        f"{target}: not found; give a run folder, a model directory, 'tiny' or '{SMOLLM2}'"
    )


def load_models(target: EvalTarget, report: Any = None) -> Models:
    """The actor of ``target`` (no critic, no reference); a run's checkpoint weights are
    loaded as a resume loads them. ``report``: a display the loading's steps are shown on."""
    from ppokit.trainer.checkpoint import load_weights
    from ppokit.trainer.models import build_models

    spec = target.spec
    models = build_models(spec.model_copy(update={"critic": None, "kl": None}), 1, report=report)
    if target.checkpoint is not None:
        try:
            load_weights(target.checkpoint, "actor", models.actor, models)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"{target.checkpoint}: cannot be loaded ({one_line(exc)})") from None
    return models


@contextmanager
def _quiet_and_threaded(spec: Spec, load: Callable[[], Models]) -> Iterator[Models]:
    """Load the models without transformers' progress bars and run with the CPU threads a
    training run of the spec uses (``model.threads``, else one for a small model on the
    CPU), so the numbers are the run's; both are put back after."""
    import torch
    from transformers.utils import logging as hf_logging

    from ppokit.trainer.threads import set_threads

    threads = torch.get_num_threads()
    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        models = load()
        set_threads(spec, models)
        yield models
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def evaluate(
    target: str,
    spec_path: str | Path | None = None,
    overrides: list[str] | None = None,
    trust_remote_code: bool = False,
    report: Any = None,
) -> dict[str, Any]:
    """``ppokit eval`` without the printing: the target, its round and the metrics. The
    evaluation runs on the spec's rollout engine, started on the loaded actor, and its
    rewards: no training state is built. ``report``: a
    :class:`~ppokit.trainer.display.Display` that shows the loading and the decoding as a
    training run's does (None: nothing is shown)."""
    resolved = load_target(target, spec_path, overrides, trust_remote_code)
    if report is not None:
        report.step("importing torch and transformers")

    from ppokit.trainer.assembly import Assembly
    from ppokit.trainer.episodes import Sampler
    from ppokit.trainer.evaluation import Evaluator
    from ppokit.trainer.rollout import PromptEncoder, engine_context
    from ppokit.trainer.scoring import Scorer

    spec = resolved.spec
    with _quiet_and_threaded(spec, lambda: load_models(resolved, report)) as models:
        assembly = Assembly.from_spec(spec)
        device = models.runtime.device
        if report is not None:
            report.step(f"starting the rollout engine ({spec.rollout.engine.name})")
        progress = report.generation if report is not None else None
        try:
            assembly.engine.start(engine_context(models, spec.model, progress=progress))
            encode = PromptEncoder(models.tokenizer, models.actor, device)
            sampler = Sampler(
                assembly.engine, assembly.environment, encode, models.tokenizer, spec.rollout
            )
            evaluator = Evaluator(spec, sampler, Scorer(assembly, models.tokenizer, device))
            if report is not None:
                prompts, size = len(evaluator.rows), evaluator.settings.batch_size
                # a greedy and a sampled pass over each batch
                report.step(
                    f"evaluating {prompts} held-out prompts", passes=2 * -(-prompts // size)
                )
            metrics = evaluator.run()
        finally:
            try:
                assembly.engine.close()
            finally:
                assembly.close()
    return {
        "model": resolved.label,
        "kind": resolved.kind,
        "round": resolved.round,
        "seed": resolved.spec.seed,
        "actor": resolved.spec.model.actor,
        "metrics": metrics,
        "seconds": round(evaluator.seconds, 3),
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    where = f"{result['kind']} {result['model']}"
    if result["round"] is not None:
        where += f", round {result['round']}"
    table = Table(title=f"ppokit eval: {escape(where)}", box=None, pad_edge=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result["metrics"].items():
        table.add_row(escape(key), _fmt(value))
    Console(highlight=False, soft_wrap=True).print(table)


def eval_command(
    target: str = typer.Argument(
        ...,
        metavar="MODEL_OR_RUN",
        help="A run folder (its latest checkpoint), a model directory (e.g. an exported "
        "model), 'tiny' or 'smollm2-135m-instruct'.",
    ),
    spec_path: Path | None = typer.Option(
        None,
        "--spec",
        help="Spec (YAML) with the eval section and the rewards; default: the run's spec, "
        "or the packaged demo spec for a model.",
    ),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a spec value: path=value (repeatable)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Run the Python code a run's spec names: its model's, when it sets "
        "model.trust_remote_code, and a python reward's function; contact the servers its "
        "rewards name (http, judge) (off: such a run is refused; a run folder is data).",
    ),
) -> None:
    """Evaluate a model or a run's latest checkpoint on the spec's held-out prompts (no
    training): greedy accuracy with its 95% interval, pass@k, mean reward and length."""
    from ppokit.trainer.display import Display

    # on stderr, from the first second: loading a real model and decoding take minutes
    display = Display(0, 0)
    try:
        result = evaluate(target, spec_path, overrides, trust_remote_code, report=display)
    except (UserError, SpecError, RegistryError, FileNotFoundError) as exc:
        display.close()
        raise fail(error_lines(exc)) from None
    finally:
        display.close()
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        _print_table(result)
