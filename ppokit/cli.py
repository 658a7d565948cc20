"""The ``ppokit`` command line: list, variants, tasks, show, validate, explain, schema, docs,
plugins, new-plugin, new-spec, train, compare, eval, export, reward-server, serve-rollouts.

Mistakes a user can make (a bad spec, an unknown component, a missing file, a broken plugin
under ``PPOKIT_STRICT_PLUGINS=1``) print one red line each on stderr and exit with status 1,
never a traceback. Torch is imported only by ``train`` (and by ``show``/``explain`` for a
component whose catalogue entry gives no formula).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ppokit import __version__, launcher
from ppokit.children import tie_to_parent
from ppokit.compare import compare_command
from ppokit.conformance import check_command
from ppokit.convert import convert_command
from ppokit.docgen import param_rows, params_table, write_docs
from ppokit.errors import (
    TRACEBACK,
    UserError,
    error_lines,
    fail,
    full_traceback,
    printable,
    tracebacks_on,
)
from ppokit.evaluate import eval_command
from ppokit.export import export_command
from ppokit.registry import (
    KINDS,
    NO_PLUGINS,
    RegistryError,
    get_registry,
    plugins_off,
    reset_registry,
)
from ppokit.serve import reward_server_command
from ppokit.serve_rollouts import serve_rollouts_command
from ppokit.spec import (
    DEFAULT_TASK,
    DEMO_SOURCE,
    DEMO_SPEC,
    Composed,
    Spec,
    SpecError,
    annotated_yaml,
    compose,
    read_demo_spec,
    spec_mapping,
    spec_warnings,
    validate_spec,
)
from ppokit.trainer.display import console_width

__all__ = ["app", "main"]

app = typer.Typer(
    name="ppokit",
    help="PPO-style RL for language models, assembled from small named components.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# a table piped into a file or another program is laid out for CONSOLE_WIDTH columns (or
# COLUMNS), not wrapped at 80
out = Console(highlight=False, soft_wrap=True, width=console_width(sys.stdout))
err = Console(stderr=True, highlight=False, soft_wrap=True)

F = TypeVar("F", bound=Callable[..., Any])

SET_HELP = "Override a spec value: path=value (repeatable), e.g. advantage.lam=0.9"
JSON_HELP = "Print the result as JSON."


# ---------------------------------------------------------------------- errors
def _show(text: str) -> str:
    """``text`` ready for a rich console: its control characters escaped (a plugin's summary
    or error cannot send escape codes to the terminal) and its markup brackets too."""
    return escape(printable(text))


def user_errors(func: F) -> F:
    """Turn the errors a user can cause into red lines and exit status 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (SpecError, UserError, RegistryError, FileNotFoundError) as exc:
            if tracebacks_on():  # for authors: the whole story first, then the one line
                err.print(_show(full_traceback(exc)), end="")
            raise fail(error_lines(exc)) from None

    return wrapper  # type: ignore[return-value]


def _warn_failed_plugins() -> None:
    registry = get_registry()
    for record in registry.failed:
        err.print(
            f"[yellow]warning: plugin {_show(record.name)} failed to load "
            f"({_show(record.error or '')}); see 'ppokit plugins'[/yellow]"
        )
    for line in registry.conflict_errors():
        err.print(f"[yellow]warning: {_show(line)}[/yellow]")


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


# ---------------------------------------------------------------------- version
def _version(value: bool) -> None:
    if value:
        typer.echo(f"ppokit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
    no_plugins: bool = typer.Option(
        False,
        "--no-plugins",
        help=f"Load no installed plugin, only the built-in components (as {NO_PLUGINS}=1).",
    ),
    show_traceback: bool = typer.Option(
        False,
        "--traceback",
        help=f"With an error, show its full traceback before its line, the traceback in a "
        f"component's worker process included (as {TRACEBACK}=1): for plugin authors.",
    ),
) -> None:
    """PPO-style RL for language models, assembled from small named components."""
    if show_traceback:  # in the environment: the processes of 'train --nproc' inherit it
        os.environ[TRACEBACK] = "1"
    if no_plugins:  # in the environment: the processes of 'train --nproc' inherit it
        os.environ[NO_PLUGINS] = "1"
        reset_registry()


# ---------------------------------------------------------------------- list / show
def _check_kind(kind: str | None) -> None:
    if kind is not None:
        get_registry().names(kind)  # raises RegistryError with close names


@app.command("list")
@user_errors
def list_components(
    kind: str | None = typer.Argument(None, help=f"Only this kind: {', '.join(KINDS)}."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """List the registered components: kind, name, plugin, summary."""
    _check_kind(kind)
    registry = get_registry()
    rows = [
        {"kind": i.kind, "name": i.name, "plugin": i.plugin, "summary": i.summary}
        for i in registry.components(kind)
    ]
    _warn_failed_plugins()
    if as_json:
        _print_json(rows)
        return
    table = Table("kind", "name", "plugin", "summary", box=None, pad_edge=False)
    for row in rows:
        table.add_row(*(_show(row[k]) for k in ("kind", "name", "plugin", "summary")))
    out.print(table)


def _entry_table(word: str, as_json: bool) -> None:
    from ppokit.named import entry_rows

    rows = entry_rows(word)
    _warn_failed_plugins()
    if as_json:
        _print_json(rows)
        return
    columns = ["name", "papers" if word == "variant" else "title", "sets", "plugin"]
    table = Table(*columns, box=None, pad_edge=False)
    for row in rows:
        table.add_row(*(_show(str(row[c])) for c in columns))
    out.print(table)


@app.command()
@user_errors
def variants(as_json: bool = typer.Option(False, "--json", help=JSON_HELP)) -> None:
    """List the registered variants (paper methods): name, paper, what it sets, plugin."""
    _entry_table("variant", as_json)


@app.command()
@user_errors
def tasks(as_json: bool = typer.Option(False, "--json", help=JSON_HELP)) -> None:
    """List the registered tasks: name, what it is, what it sets, plugin."""
    _entry_table("task", as_json)


def _show_entry(word: str, name: str, as_json: bool) -> None:
    from ppokit.named import show_entry

    data = show_entry(word, name)
    if as_json:
        _print_json(data)
        return
    out.print(f"[bold]{word} {_show(name)}[/bold]  {_show(data['title'])}")
    out.print(f"plugin: {_show(data['plugin'])} {_show(data['version'] or '')}".rstrip())
    for label, key in (("paper", "papers"), ("extends", "base"), ("source", "source")):
        values = data.get(key)
        for value in values if isinstance(values, list) else [values] if values else []:
            out.print(f"{label}: {_show(value)}")
    for key in ("choices", "scaled", "about"):
        if data.get(key):
            out.print(f"{key}: {_show(data[key])}")
    out.print("settings:")
    for line in data["settings"].splitlines():
        out.print("  " + _show(line))
    if data.get("explain"):
        out.print(f"\nthe objective it assembles (on the {DEFAULT_TASK} task):")
        out.print(_show(data["explain"]).rstrip())


@app.command()
@user_errors
def show(
    kind: str = typer.Argument(..., help="Component kind, or 'variant' or 'task'."),
    name: str = typer.Argument(..., help="Component, variant or task name."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Show one component (parameters, formula, required batch fields, source, plugin), or
    one variant or task (its papers, settings and, for a variant, the objective)."""
    if kind in ("variant", "task"):
        _show_entry(kind, name, as_json)
        return
    info = get_registry().info(kind, name)
    rows = param_rows(info.params)
    data = {
        "kind": info.kind,
        "name": info.name,
        "plugin": info.plugin,
        "version": info.version,
        "summary": info.summary,
        "formula": info.formula,
        "requires": list(info.requires),
        "source": info.source,
        "parameters": [row.as_dict() for row in rows],
    }
    if as_json:
        _print_json(data)
        return
    out.print(f"[bold]{_show(kind)} {_show(name)}[/bold]  {_show(info.summary)}")
    out.print(f"plugin: {_show(info.plugin)} {_show(info.version or '')}".rstrip())
    if info.source:
        out.print(f"source: {_show(info.source)}")
    out.print("requires: " + (", ".join(info.requires) or "-"))
    if data["formula"]:
        out.print("formula:")
        for line in str(data["formula"]).splitlines():
            out.print("  " + _show(line))
    if not rows:
        out.print("parameters: none")
        return
    out.print(params_table(rows))


# ---------------------------------------------------------------------- specs
def _composed(spec_path: Path | None, overrides: list[str]) -> tuple[Composed, Spec]:
    """The spec file (or variant or task name; None: the packaged demo spec) composed with
    its variant, task and ``overrides``, and validated."""
    if spec_path is None:
        data, source = read_demo_spec(), DEMO_SOURCE
    else:
        data, source = spec_mapping(spec_path), str(spec_path)
    label = source if spec_path is None or spec_path.exists() else "the command line"
    try:
        composed = compose(data, overrides, label=label)
        return composed, validate_spec(composed.data)
    except SpecError as exc:
        raise SpecError(exc.errors, source=exc.source or source) from None


def _load(spec_path: Path, overrides: list[str]) -> Spec:
    return _composed(spec_path, overrides)[1]


@app.command()
@user_errors
def validate(
    specs: list[Path] = typer.Argument(
        ..., help="Spec files (YAML), or variant or task names.", metavar="SPEC..."
    ),
    overrides: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Validate spec files: every error, one 'path: message' line each."""
    results: list[dict[str, Any]] = []
    for path in specs:
        try:
            spec = _load(path, overrides)
        except SpecError as exc:
            results.append({"spec": str(path), "valid": False, "errors": exc.errors})
        else:
            warnings = spec_warnings(spec)
            results.append({"spec": str(path), "valid": True, "errors": [], "warnings": warnings})
    if as_json:
        _print_json(results)
    else:
        for r in results:
            if r["valid"]:
                out.print(f"{_show(r['spec'])}: [green]valid[/green]")
                for line in r["warnings"]:
                    err.print(f"[yellow]{_show(r['spec'])}: warning: {_show(line)}[/yellow]")
            else:
                for line in r["errors"]:
                    err.print(f"[red]{_show(r['spec'])}: {_show(line)}[/red]")
    if not all(r["valid"] for r in results):
        raise typer.Exit(1)


@app.command()
@user_errors
def explain(
    spec_path: Path = typer.Argument(
        ..., help="Spec file (YAML), or a variant or task name.", metavar="SPEC"
    ),
    overrides: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
) -> None:
    """Write out the actor and critic objectives a spec assembles."""
    from ppokit.explain import explain as explain_spec

    spec = _load(spec_path, overrides)
    typer.echo(explain_spec(spec, source=str(spec_path)), nl=False)


@app.command()
@user_errors
def schema() -> None:
    """Print the JSON Schema of a spec for the installed components."""
    from ppokit.schema import spec_schema

    _print_json(spec_schema())


@app.command()
@user_errors
def docs(
    out_dir: Path = typer.Option(Path("docs"), "--out", help="Where the docs go."),
    check: bool = typer.Option(
        False, "--check", help="Write nothing; exit 1 naming each out-of-date file."
    ),
) -> None:
    """Generate components.md, variants.md and spec.md from the registry (in a checkout: the
    built-ins and the plugins kept in plugins/; elsewhere: the installed ones)."""
    stale = write_docs(out_dir, check=check)
    if check and stale:
        raise fail([f"{path}: out of date; run 'ppokit docs'" for path in stale])
    for path in stale:
        out.print(f"wrote {_show(str(path))}")
    if not stale:
        out.print(f"{_show(str(out_dir))}: up to date")


@app.command()
@user_errors
def plugins(as_json: bool = typer.Option(False, "--json", help=JSON_HELP)) -> None:
    """Loaded plugins with their version and components, and those that failed."""
    registry = get_registry()
    records: list[dict[str, Any]] = [
        {
            "name": p.name,
            "distribution": p.distribution,
            "version": p.version,
            "ok": p.ok,
            "error": p.error,
            "components": [f"{k}/{n}" for k, n in p.components],
        }
        for p in registry.plugins.values()
    ]
    conflicts = registry.conflict_errors()
    if as_json:
        _print_json({"plugins": records, "conflicts": conflicts})
        return
    if plugins_off():
        err.print(f"installed plugins are off ({NO_PLUGINS}=1 or --no-plugins)")
    for r in records:
        head = f"{r['name']} {r['version'] or ''}".rstrip()
        if r["distribution"] and r["distribution"] != r["name"]:
            head += f" ({r['distribution']})"
        if r["ok"]:
            out.print(f"[green]{_show(head)}[/green]: {len(r['components'])} component(s)")
            by_kind: dict[str, list[str]] = {}
            for comp in r["components"]:
                kind, _, cname = comp.partition("/")
                by_kind.setdefault(kind, []).append(cname)
            for kind, names in by_kind.items():
                out.print(f"  {kind}: {_show(', '.join(names))}")
        else:
            out.print(f"[red]{_show(head)}: failed: {_show(r['error'] or '')}[/red]")
    for line in conflicts:
        out.print(f"[red]conflict: {_show(line)}[/red]")


@app.command("new-plugin")
@user_errors
def new_plugin(
    name: str = typer.Argument(..., help="Plugin name (the distribution is ppokit-NAME)."),
    directory: Path = typer.Option(Path("."), "--dir", help="Where to create ppokit-NAME/."),
) -> None:
    """Scaffold a plugin distribution with one working component, its tests and a README."""
    from ppokit.scaffold import new_plugin as scaffold

    root = scaffold(name, directory)
    out.print(f"created {_show(str(root))}")
    out.print(f"next: {_show(install_hint(root))}")


@app.command("new-spec")
@user_errors
def new_spec(
    variant: str = typer.Argument(..., help="The variant ('ppokit variants' lists them)."),
    task: str = typer.Option(DEFAULT_TASK, "--task", help="The task ('ppokit tasks')."),
    model: str = typer.Option("tiny", "--model", help="The actor (model.actor)."),
    out_file: Path | None = typer.Option(
        None, "--out", help="Write the spec to this new file (default: standard output)."
    ),
) -> None:
    """Write a commented spec to start from: VARIANT on a task and a model."""
    from ppokit.named import new_spec as make
    from ppokit.named import write_new_spec

    write_new_spec(make(variant, task, model), out_file)
    if out_file is not None:
        err.print(
            f"wrote {_show(str(out_file))}; train it with: ppokit train {_show(str(out_file))}"
        )


def install_hint(root: Path) -> str:
    """``pip install -e './ppokit-NAME[test]' && python -m pytest ppokit-NAME/tests``: the
    scaffold installed with its test extra (pytest, hypothesis), then its tests."""
    import shlex

    path = str(root) if root.is_absolute() else f"./{root}"
    tests = shlex.quote(str(root / "tests"))
    return f"pip install -e {shlex.quote(path + '[test]')} && python -m pytest {tests}"


@app.command()
@user_errors
def train(
    spec_path: Path | None = typer.Argument(
        None,
        help="Spec file (YAML), or a variant name (on the demo task) or a task name; "
        "default: the packaged demo spec.",
        metavar="[SPEC]",
    ),
    overrides: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    out_dir: str | None = typer.Option(None, "--out", help="Output directory (output.dir)."),
    seed: int | None = typer.Option(None, "--seed", help="Random seed (seed)."),
    threads: int | None = typer.Option(
        None,
        "--threads",
        min=1,
        help="CPU threads of torch (model.threads; default: 1 for a small model on a CPU).",
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue from the last checkpoint."),
    allow_spec_change: bool = typer.Option(
        False,
        "--allow-spec-change",
        help="With --resume: continue with a spec that differs from the run's in what it "
        "optimises (recorded in spec_changes.jsonl).",
    ),
    smoke: bool = typer.Option(False, "--smoke", help="A minimal run that checks the setup."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing run (only the files a run wrote)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the run's summary as JSON."),
    print_spec: bool = typer.Option(
        False,
        "--print-spec",
        help="Print the spec that would run (YAML: the demo spec when no SPEC is given, with "
        "--set, --out, --seed, --threads and --smoke applied), each value with where it comes "
        "from (default, variant, task, the file or --set), and exit without training.",
    ),
    nproc: int = typer.Option(
        1,
        "--nproc",
        min=1,
        help="Processes on this machine (torch's launcher, as torchrun --nproc-per-node; "
        "GPUs: one each). For several machines run torchrun -m ppokit train ... yourself.",
    ),
) -> None:
    """Train a policy as the spec describes (Ctrl-C or SIGTERM stops it, saving its last
    finished round: exit status 130, with the command that resumes it)."""
    extra = [*overrides]
    if out_dir is not None:
        extra.append(f"output.dir={json.dumps(out_dir)}")
    if seed is not None:
        extra.append(f"seed={seed}")
    if threads is not None:
        extra.append(f"model.threads={threads}")
    composed, spec = _composed(spec_path, extra)
    if print_spec:
        if smoke:
            from ppokit.trainer.lifecycle.smoke import smoke_spec

            smoke_run = smoke_spec(spec, out_dir or "<a new temporary directory>")
            for path in _changed_paths(spec, smoke_run):
                composed.mark(path, "--smoke")
            spec = smoke_run
        source = f"the packaged demo spec ({DEMO_SPEC})" if spec_path is None else spec_path
        typer.echo(
            f"# ppokit train: {source}, resolved; each value's comment says where it comes "
            "from\n" + annotated_yaml(spec, composed),
            nl=False,
        )
        return
    if nproc > 1:  # the spec is valid: each process reads it again
        argv = ["train", *_train_args(spec_path, overrides, seed, threads)]
        if out_dir is not None:
            argv += ["--out", out_dir]
        flags = {
            "--resume": resume,
            "--allow-spec-change": allow_spec_change,
            "--smoke": smoke,
            "--overwrite": overwrite,
            "--json": as_json,
        }
        argv += [flag for flag, on in flags.items() if on]
        with launcher.smoke_temp(smoke and out_dir is None):
            status, ended = launcher.launch(nproc, argv)
        if any(" by signal " in line for line in ended) and not smoke:
            command = ["ppokit", "train", *_train_args(spec_path, overrides, seed, threads)]
            ended += launcher.how_to_continue(
                Path(spec.output.dir), [*command, "--nproc", str(nproc)]
            )
        if ended:
            raise fail(ended, status)
        raise typer.Exit(status)
    from ppokit.trainer.loop import train as run_training

    if int(os.environ.get("RANK", "0")) == 0:  # before torch's import: seconds on a busy CPU
        err.print("ppokit: importing torch and transformers", markup=False)
    try:
        result = run_training(
            spec,
            resume=resume,
            smoke=smoke,
            overwrite=overwrite,
            smoke_out=out_dir,
            allow_spec_change=allow_spec_change,
        )
    except KeyboardInterrupt as exc:
        if int(os.environ.get("RANK", "0")) != 0:  # the first process says it, once
            raise typer.Exit(130) from None
        command = _resume_base(spec_path, overrides, seed, threads)
        describe = getattr(exc, "describe", None)
        lines = describe(command) if callable(describe) else ["interrupted"]
        for line in lines:
            err.print(f"[yellow]{_show(line)}[/yellow]")
        raise typer.Exit(130) from None
    except UserError as exc:  # a run stopped by it: its .stopped says how to go on
        stopped = getattr(exc, "stopped", None)
        if stopped is None:
            raise
        if tracebacks_on():
            err.print(_show(full_traceback(exc)), end="")
        command = _resume_base(spec_path, overrides, seed, threads)
        raise fail(stopped.lines(command)) from None
    if as_json and result.get("main", True):
        _print_json(result)


def _changed_paths(spec: Spec, changed: Spec) -> list[str]:
    """The section values in which ``changed`` (a smoke run's spec) differs from ``spec``."""
    before, after = spec.model_dump(), changed.model_dump()
    return [
        f"{section}.{key}"
        for section, values in after.items()
        if isinstance(values, dict) and isinstance(before.get(section), dict)
        for key, value in values.items()
        if before[section].get(key) != value
    ]


def _resume_base(
    spec_path: Path | None, overrides: list[str], seed: int | None, threads: int | None
) -> list[str]:
    """The ``ppokit train SPEC [--set ...]`` that resumes this process's run."""
    command = ["ppokit", "train", *_train_args(spec_path, overrides, seed, threads)]
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1 and os.environ.get("LOCAL_WORLD_SIZE") == str(processes):
        command += ["--nproc", str(processes)]
    return command


def _train_args(
    spec_path: Path | None, overrides: list[str], seed: int | None, threads: int | None
) -> list[str]:
    """``[SPEC] [--set ...] [--seed N] [--threads N]`` of a ``ppokit train`` command."""
    args = [str(spec_path)] if spec_path is not None else []
    for item in overrides:
        args += ["--set", item]
    for flag, value in (("--seed", seed), ("--threads", threads)):
        if value is not None:
            args += [flag, str(value)]
    return args


app.command("compare")(compare_command)
app.command("check")(check_command)
app.command("export")(export_command)
app.command("convert")(convert_command)
app.command("eval")(eval_command)
app.command("reward-server")(reward_server_command)
app.command("serve-rollouts")(serve_rollouts_command)


def main(argv: list[str] | None = None) -> None:
    """Console entry point. A process started with :data:`ppokit.children.PARENT` ends with
    that parent; a command ends when its work is done, even if a plugin left a thread
    running that is not a daemon (Python would wait for it forever). Run as the ``ppokit``
    command (``argv`` None: the console script, ``python -m ppokit``), a command ends once
    its exit functions have run and its open files are flushed, without Python's teardown
    of its modules (with torch and transformers, thousands: seconds after the last line,
    more on a busy machine)."""
    tie_to_parent()
    try:
        app(args=argv, prog_name="ppokit")
    except SystemExit as exc:
        code = exc.code
        status = code if isinstance(code, int) else 0 if code is None else 1
        _end_past_stray_threads(status)
        if argv is None and (code is None or isinstance(code, int)):
            _end_without_teardown(status)
        raise


#: Seconds a command waits, after its work, for threads that are not daemons to end.
STRAY_GRACE = 5.0
#: Seconds of that wait after which it says which threads it waits for.
STRAY_QUIET = 0.5


def _end_past_stray_threads(code: int) -> None:
    """End the process now, with ``code``, when a thread that is not a daemon is still
    running STRAY_GRACE seconds after the command's work (output flushed, logging shut
    down): nothing of the command's is left to do. Past STRAY_QUIET seconds it names the
    threads it waits for."""
    import logging
    import threading
    import time

    main_thread = threading.main_thread()
    stray = [t for t in threading.enumerate() if t is not main_thread and not t.daemon]
    if not stray:
        return
    start = time.monotonic()
    told = False
    for thread in stray:  # a thread finishing its work gets the time to
        while thread.is_alive() and (left := start + STRAY_GRACE - time.monotonic()) > 0:
            if not told and time.monotonic() - start >= STRAY_QUIET:
                names = ", ".join(t.name for t in stray if t.is_alive())
                err.print(
                    f"ppokit: waiting up to {STRAY_GRACE:g} s for threads to end: {names}",
                    markup=False,
                )
                told = True
            thread.join(min(left, STRAY_QUIET) if not told else left)
    if not any(t.is_alive() for t in stray):
        return
    logging.shutdown()
    _flush_files()
    os._exit(code)


def _end_without_teardown(code: int) -> None:
    """End the process now, with ``code``, as Python would but for the teardown of its
    modules: the exit functions run (logging's, trackers', worker pools'), then every open
    file is flushed."""
    import atexit

    atexit._run_exitfuncs()
    _flush_files()
    os._exit(code)


def _flush_files() -> None:
    """Flush every open Python file object (the standard streams last)."""
    import gc
    import io

    buffered = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)
    for obj in gc.get_objects():  # by type: no attribute of a lazy module's proxy is read
        if type(obj) in buffered:
            with contextlib.suppress(Exception):
                if not obj.closed:
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
