"""Held-out evaluation (``spec.eval``) and the ``ppokit eval`` command.

:class:`Evaluator` ``(spec, learner).run()`` generates, for each of the evaluation prompts,
one greedy response and ``eval.k`` sampled ones, scores them with the spec's rewards
(``learner.score``: the rewards summed with their weights) and returns:

=============================  =============================================================
``eval/accuracy``              fraction of prompts whose greedy response is correct
                               (combined reward ``>= eval.correct_at``)
``eval/accuracy_ci95``         half-width of the 95% Wilson score interval of that fraction
``eval/pass@{k}``              unbiased pass@k (Chen et al. 2021) of the k samples of each
                               prompt (:func:`ppokit.stats.pass_at_k`), averaged over prompts
``eval/reward_mean``           mean combined reward of the sampled responses
``eval/response_length_mean``  mean length (tokens) of the sampled responses
``eval/prompts``               number of evaluation prompts
=============================  =============================================================

The prompts are the first ``eval.prompts`` rows of ``eval.data`` read in order (``shuffle``
off; a data file with fewer rows gives all of them, each once), its generator seeded with
:func:`eval_seed` ``(spec.seed)``: the same prompts at every evaluation of a run and in
``ppokit eval``, and for a generated source (``demo``, ``arithmetic``) not the rows the run
trains on. The sampling runs under a forked RNG seeded with :func:`eval_seed`, so an
evaluation does not move the training run's random streams (a run with evaluations trains
exactly like one without), every evaluation of a run draws the same sampling noise, and
``ppokit eval RUN`` reproduces the run's own evaluation at the checkpoint's round.

Generation is batched (``eval.batch_size`` prompts at a time) under ``torch.no_grad()`` with
the actor in eval mode (its mode is restored after); ``eval.max_new_tokens`` replaces
``rollout.max_new_tokens`` for the evaluation only; sampling uses ``eval.temperature`` and
``eval.top_p`` (no top-k). Apart from the decoded responses the rewards need, the metric
tensors are read back to the host once, at the end.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ppokit import distributed
from ppokit.errors import UserError, error_lines, fail
from ppokit.registry import RegistryError
from ppokit.spec import Spec, SpecError, apply_overrides, read_spec_file, validate_spec
from ppokit.stats import pass_at_k

if TYPE_CHECKING:
    import torch

    from ppokit.trainer.rollout import Rollout
    from ppokit.trainer.round import Learner

__all__ = [
    "EvalTarget",
    "Evaluator",
    "build_learner",
    "eval_command",
    "eval_rows",
    "eval_seed",
    "evaluate",
    "isolated_rng",
    "load_target",
    "wilson_half_width",
    "wilson_interval",
]

#: The two-sided 95% quantile of the standard normal distribution.
Z95 = 1.959963984540054


def eval_seed(seed: int) -> int:
    """The seed of a run's evaluation, from ``(spec.seed, "eval")``: a 63-bit integer."""
    digest = hashlib.sha256(f"ppokit:{int(seed)}:eval".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def wilson_half_width(successes: int, n: int, z: float = Z95) -> float:
    """Half the width of the Wilson score interval of a proportion ``successes / n``.

    ``z / (1 + z²/n) · sqrt(p̂(1 − p̂)/n + z²/(4n²))``; unlike the normal approximation it is
    not 0 when every prompt (or none) is correct. The interval is centred on
    ``(p̂ + z²/(2n)) / (1 + z²/n)``, which is p̂ shrunk towards 1/2. ``nan`` for ``n = 0``.
    """
    if n <= 0:
        return math.nan
    p = successes / n
    zz = z * z
    return z / (1 + zz / n) * math.sqrt(p * (1 - p) / n + zz / (4 * n * n))


def wilson_interval(accuracy: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The 95% Wilson score interval ``(low, high)`` of a proportion ``accuracy`` over ``n``
    prompts (what ``eval/accuracy`` and ``eval/accuracy_ci95`` describe, e.g. to plot it)."""
    if n <= 0:
        return math.nan, math.nan
    zz = z * z
    centre = (accuracy + zz / (2 * n)) / (1 + zz / n)
    half = wilson_half_width(round(accuracy * n), n, z)
    return max(0.0, centre - half), min(1.0, centre + half)


def eval_rows(spec: Spec) -> list[dict[str, Any]]:
    """The evaluation prompts' data rows: the first ``eval.prompts`` rows of ``eval.data``,
    in order (at most one pass over a data file), the generator seeded with
    :func:`eval_seed`."""
    from ppokit.data import make_prompt_source

    settings = spec.eval
    if settings is None:
        raise UserError("the spec has no eval section")
    data = settings.data.model_copy(update={"shuffle": False})
    source = make_prompt_source(data, eval_seed(spec.seed))
    size = getattr(source, "size", None)
    count = settings.prompts if size is None else min(settings.prompts, int(size))
    return source.next_rows(count)


@contextmanager
def isolated_rng(seed: int, device: Any) -> Iterator[None]:
    """Run the body with torch's RNG (CPU and the run's accelerator) seeded with ``seed``,
    then put every RNG state back, python's and numpy's too."""
    import numpy as np
    import torch

    devices: list[int] = []
    device_type = getattr(device, "type", str(device))
    if device_type != "cpu":
        backend = getattr(torch, device_type, None)
        count = getattr(backend, "device_count", None)
        devices = list(range(count())) if callable(count) else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    kwargs = {"device_type": device_type} if device_type not in ("cpu", "cuda") else {}
    with torch.random.fork_rng(devices=devices, **kwargs):
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


class Evaluator:
    """The held-out evaluation of ``spec.eval`` with ``learner``'s actor and rewards.

    The prompts are read and formatted once, here; :meth:`run` evaluates the actor as it is
    now. ``seconds`` is the duration of the last :meth:`run`.
    """

    def __init__(self, spec: Spec, learner: Learner) -> None:
        from ppokit.data import format_prompts

        if spec.eval is None:
            raise UserError("the spec has no eval section")
        self.spec = spec
        self.settings = spec.eval
        self.learner = learner
        self.seed = eval_seed(spec.seed)
        self.rows = eval_rows(spec)
        self.formatted = format_prompts(self.rows, learner.models.tokenizer, self.settings.data)
        self.max_new_tokens = self.settings.max_new_tokens or spec.rollout.max_new_tokens
        self.seconds = 0.0

    @property
    def names(self) -> list[str]:
        """The metric names :meth:`run` returns."""
        return [
            "eval/accuracy",
            "eval/accuracy_ci95",
            f"eval/pass@{self.settings.k}",
            "eval/reward_mean",
            "eval/response_length_mean",
            "eval/prompts",
        ]

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts: list[str], n: int, greedy: bool) -> Rollout:
        from ppokit.trainer.models import autocast
        from ppokit.trainer.rollout import generate

        models = self.learner.models
        ids, attn = self.learner.encode(prompts, n, self.settings.data, self.max_new_tokens)
        sampling: dict[str, Any] = (
            {"greedy": True}
            if greedy
            else {"temperature": self.settings.temperature, "top_p": self.settings.top_p}
        )
        with autocast(models.runtime):
            return generate(
                models.actor,
                models.tokenizer,
                ids,
                attn,
                max_new_tokens=self.max_new_tokens,
                **sampling,
            )

    def _scores(self, rows: list[dict[str, Any]], ro: Rollout, n: int) -> torch.Tensor:
        """The combined reward of each response (``n`` per row), float32 on the device."""
        expanded = [row for row in rows for _ in range(n)]
        texts, lengths, truncated = self.learner.decode(ro)
        scores, _ = self.learner.score(expanded, texts, lengths, truncated)
        return scores.float().reshape(-1)

    def _batch(
        self, rows: list[dict[str, Any]], prompts: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(greedy rewards [b], sampled rewards [b, k], sampled lengths [b, k])."""
        k = self.settings.k
        greedy = self._scores(rows, self._generate(prompts, 1, greedy=True), 1)
        sampled = self._generate(prompts, k, greedy=False)
        scores = self._scores(rows, sampled, k).view(len(rows), k)
        lengths = sampled.response_mask.float().sum(1).view(len(rows), k)
        return greedy, scores, lengths

    # ------------------------------------------------------------------ metrics
    def run(self) -> dict[str, float | None]:
        """Evaluate the actor: the ``eval/...`` metrics (None for a non-finite mean)."""
        import torch

        start = time.perf_counter()
        actor = self.learner.models.actor
        was_training = actor.training
        size = self.settings.batch_size
        rows, formatted = self.rows, self.formatted
        world = distributed.world()
        if world.distributed:  # equal contiguous shares (the last padded with its last prompt)
            each = -(-len(rows) // world.size)
            pad = each * world.size - len(rows)
            share = slice(world.rank * each, (world.rank + 1) * each)
            rows = (rows + rows[-1:] * pad)[share]
            formatted = (formatted + formatted[-1:] * pad)[share]
        parts = []
        with isolated_rng(self.seed ^ world.rank, self.learner.device), torch.no_grad():
            actor.eval()
            try:
                for i in range(0, len(rows), size):
                    parts.append(self._batch(rows[i : i + size], formatted[i : i + size]))
            finally:
                actor.train(was_training)
        greedy = torch.cat([p[0] for p in parts])
        sampled = torch.cat([p[1] for p in parts])
        lengths = torch.cat([p[2] for p in parts])
        if world.distributed:  # every process's prompts, in order, without the padding
            n = len(self.rows)
            greedy = distributed.gather_rows(greedy)[:n]
            sampled = distributed.gather_rows(sampled)[:n]
            lengths = distributed.gather_rows(lengths)[:n]
        metrics = self.metrics(greedy, sampled, lengths)
        self.seconds = time.perf_counter() - start
        return metrics

    def metrics(
        self, greedy: torch.Tensor, sampled: torch.Tensor, lengths: torch.Tensor
    ) -> dict[str, float | None]:
        """The metrics of greedy rewards ``[P]``, sampled rewards ``[P, k]`` and sampled
        lengths ``[P, k]`` (one host read)."""
        import torch

        threshold = self.settings.correct_at
        prompts, k = sampled.shape
        packed = torch.cat(
            [
                (greedy >= threshold).float(),
                (sampled >= threshold).sum(1).float(),
                sampled.mean().reshape(1),
                lengths.mean().reshape(1),
            ]
        ).tolist()
        correct = [int(x) for x in packed[:prompts]]
        counts = [int(x) for x in packed[prompts : 2 * prompts]]
        reward_mean, length_mean = packed[-2], packed[-1]
        solved = sum(correct)
        return {
            "eval/accuracy": solved / prompts,
            "eval/accuracy_ci95": wilson_half_width(solved, prompts),
            f"eval/pass@{k}": math.fsum(pass_at_k(k, c, k) for c in counts) / prompts,
            "eval/reward_mean": reward_mean if math.isfinite(reward_mean) else None,
            "eval/response_length_mean": length_mean,
            "eval/prompts": float(prompts),
        }


# --------------------------------------------------------------------------- ppokit eval
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


def _packaged_demo_spec() -> dict[str, Any]:
    from importlib.resources import files

    import yaml

    resource = files("ppokit") / "specs" / "demo.yaml"
    data = yaml.safe_load(resource.read_text()) if resource.is_file() else None
    if not isinstance(data, dict):
        raise UserError("the packaged demo spec ppokit/specs/demo.yaml is missing")
    return data


def _is_run_folder(path: Path) -> bool:
    from ppokit.runfolder import has_checkpoint

    if not path.is_dir() or (path / "config.json").is_file():
        return False
    return has_checkpoint(path) or (path / "spec.yaml").is_file()


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
    from ppokit.trainer.checkpoint import _locate, _state_of
    from ppokit.trainer.models import SMOLLM2

    overrides = list(overrides or [])
    source = str(spec_path) if spec_path is not None else None
    base = read_spec_file(spec_path) if spec_path is not None else None
    path = Path(target).expanduser()
    if _is_run_folder(path):
        from ppokit.runfolder import has_checkpoint, read_run_spec

        if not has_checkpoint(path):
            raise UserError(f"{path}: the run has no checkpoint yet: nothing to evaluate")
        folder = _locate(path)  # every checksum verified
        round_no = int(_state_of(folder)["round"])
        run_data = read_run_spec(folder, trust_remote_code=trust_remote_code)
        data = copy.deepcopy(base) if base is not None else copy.deepcopy(run_data)
        data["model"] = copy.deepcopy(run_data.get("model") or {})
        data["seed"] = run_data.get("seed", 0)
        spec = _finish_spec(data, overrides, source or str(folder / "spec.yaml"))
        return EvalTarget(spec, "run", str(path), folder, round_no)
    if target in ("tiny", SMOLLM2) or (path.is_dir() and (path / "config.json").is_file()):
        data = copy.deepcopy(base) if base is not None else _packaged_demo_spec()
        model = dict(data.get("model") or {})
        model["actor"] = target if target in ("tiny", SMOLLM2) else str(path)
        data["model"] = model
        spec = _finish_spec(data, overrides, source or "demo.yaml")
        return EvalTarget(spec, "model", target, None, None)
    if path.exists():
        raise UserError(
            f"{target}: neither a run folder (checkpoint/ and spec.yaml) nor a model "
            "directory (config.json)"
        )
    raise UserError(
        f"{target}: not found; give a run folder, a model directory, 'tiny' or '{SMOLLM2}'"
    )


def build_learner(target: EvalTarget) -> Learner:
    """The actor of ``target`` (no critic, no reference) in a learner that scores with the
    spec's rewards; a run's checkpoint weights are loaded as a resume loads them."""
    from ppokit.trainer.assembly import Assembly
    from ppokit.trainer.checkpoint import load_weights
    from ppokit.trainer.models import build_models
    from ppokit.trainer.round import Learner

    spec = target.spec
    assembly = Assembly.from_spec(spec)
    models = build_models(spec.model_copy(update={"critic": None, "kl": None}), 1)
    if target.checkpoint is not None:
        try:
            load_weights(target.checkpoint, "actor", models.actor, models)
        except UserError:
            raise
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise UserError(f"{target.checkpoint}: cannot be loaded ({text})") from None
    return Learner(spec, models, assembly)


@contextmanager
def _quiet_and_threaded(spec: Spec, learner_factory: Any) -> Iterator[Learner]:
    """Build the learner without transformers' progress bars and run with the CPU threads a
    training run of the spec uses (``model.threads``, else one for a small model on the
    CPU), so the numbers are the run's; both are put back after."""
    import torch
    from transformers.utils import logging as hf_logging

    from ppokit.trainer.loop import choose_threads

    threads = torch.get_num_threads()
    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        learner = learner_factory()
        models = learner.models
        parameters = sum(p.numel() for p in models.actor.parameters())
        chosen, _ = choose_threads(spec.model.threads, models.runtime.device.type, parameters)
        if chosen is not None:
            torch.set_num_threads(chosen)
        yield learner
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
) -> dict[str, Any]:
    """``ppokit eval`` without the printing: the target, its round and the metrics."""
    resolved = load_target(target, spec_path, overrides, trust_remote_code)
    with _quiet_and_threaded(resolved.spec, lambda: build_learner(resolved)) as learner:
        evaluator = Evaluator(resolved.spec, learner)
        metrics = evaluator.run()
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
        help="Run the Python code of the model a run's spec names, when that spec sets "
        "model.trust_remote_code (off: such a run is refused; a run folder is data).",
    ),
) -> None:
    """Evaluate a model or a run's latest checkpoint on the spec's held-out prompts (no
    training): greedy accuracy with its 95% interval, pass@k, mean reward and length."""
    try:
        result = evaluate(target, spec_path, overrides, trust_remote_code)
    except (UserError, SpecError, RegistryError, FileNotFoundError) as exc:
        raise fail(error_lines(exc)) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        _print_table(result)
