"""ppokit's modules import downwards only: no import cycle, at module level, inside a
function (a lazy import is still a dependency) or for type checking only (a type a reader
must hold in their head too), no class grows past a reader's sitting and no module past one
job's length."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ppokit"

#: The longest a class may be, in lines.
MAX_CLASS_LINES = 350
#: The longest a module may be, in lines.
MAX_MODULE_LINES = 800
#: Modules still longer, each with the length it may not grow past until it is split
#: (docs/design.md): the spec's models, validation, YAML and --set language; the
#: checkpoint's writer, reader and checks.
LONG_MODULES: dict[str, int] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, modules: set[str], package: str, type_only: bool = False) -> set[str]:
    """The ppokit modules a module's code imports (``type_only``: with its TYPE_CHECKING
    blocks' imports)."""
    found: set[str] = set()

    def target(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (t := target(alias.name)) is not None:
                    found.add(t)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                full = f"{base}.{alias.name}"
                t = full if full in modules else target(base)
                if t is not None:
                    found.add(t)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    files = {
        _module_name(p): p
        for p in PACKAGE.rglob("*.py")
        if "templates" not in p.relative_to(PACKAGE).parts
    }
    modules = set(files)
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = _imports(ast.parse(path.read_text()), modules, package, type_only)
        graph[name] = {e for e in edges if e != name and e != "ppokit"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    assert "ppokit.trainer.threads" in graph["ppokit.evaluate"]  # the graph sees lazy imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_import_graph_has_no_cycle_for_type_checking_either() -> None:
    graph = _graph(type_only=True)
    assert "ppokit.trainer.setup" in graph["ppokit.trainer.evaluation"]  # a type-only import
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


#: The lifecycle: ``train`` (the loop) and the pieces of a run around its rounds.
LOOP = "ppokit.trainer.loop"
LIFECYCLE = "ppokit.trainer.lifecycle"


def _lifecycle(module: str) -> bool:
    return module in (LOOP, LIFECYCLE) or module.startswith(f"{LIFECYCLE}.")


def test_nothing_below_the_round_imports_it() -> None:
    """The round module is the recipe: the steps it calls know nothing of it; the loop,
    which runs it on what a producer made, and the lifecycle's records are above it."""
    graph = _graph(type_only=True)
    users = sorted(m for m, edges in graph.items() if "ppokit.trainer.round" in edges)
    assert users == [f"{LIFECYCLE}.records", LOOP]


def test_the_round_and_the_run_know_nothing_of_the_lifecycle() -> None:
    """The lifecycle (the loop and ``trainer/lifecycle/``) is on top: the round, the
    producers, the run's build and every other trainer module import none of it; only the
    CLI (which runs ``train``) does from outside the trainer."""
    graph = _graph(type_only=True)
    for module, edges in graph.items():
        if _lifecycle(module) or module == "ppokit.trainer":  # train() imports it lazily
            continue
        used = sorted(e for e in edges if _lifecycle(e))
        assert not used or module == "ppokit.cli", f"{module} imports {used}"


#: The package of the schedules that make a round's batch (docs/design.md, "Producers").
PRODUCERS = "ppokit.trainer.producers"
#: Who may import it from outside: the lifecycle's start (which makes the run's producer)
#: and the round (the type of what it trains on, from ``producers.base`` alone).
PRODUCER_USERS = {f"{LIFECYCLE}.resume": None, "ppokit.trainer.round": {f"{PRODUCERS}.base"}}


def test_only_the_lifecycle_and_the_round_import_the_producers() -> None:
    """A schedule is a producer module: nothing else in the trainer knows how a batch was
    made (the round imports the type of what it trains on, nothing more), and no producer
    imports the round or the lifecycle."""
    graph = _graph(type_only=True)
    inside = {m for m in graph if m == PRODUCERS or m.startswith(f"{PRODUCERS}.")}
    for module, edges in graph.items():
        if module in inside:
            assert "ppokit.trainer.round" not in edges, module
            assert not any(_lifecycle(e) for e in edges), module
            continue
        used = edges & inside
        if not used:
            continue
        assert module in PRODUCER_USERS, f"{module} imports {sorted(used)}"
        allowed = PRODUCER_USERS[module]
        assert allowed is None or used <= allowed, f"{module} imports {sorted(used)}"


def test_a_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_class_is_longer_than_a_sitting() -> None:
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({lines} lines)")
    assert not long


def test_every_import_of_ppokit_names_a_module_that_exists() -> None:
    """A lazy import of a moved or deleted module fails only when its line runs: find it
    here instead."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py") if "templates" not in p.parts}
    missing = []
    for path in PACKAGE.rglob("*.py"):
        if "templates" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.split(".")[0] == "ppokit" and name not in modules:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not missing


def test_no_module_is_longer_than_one_job() -> None:
    lengths = {
        path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    long = {p: n for p, n in lengths.items() if n > LONG_MODULES.get(p, MAX_MODULE_LINES)}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: split them by job: {long}"
    for path in LONG_MODULES:  # an entry goes once its module is split
        assert lengths.get(path, 0) > MAX_MODULE_LINES, f"{path} is short now: drop its entry"


def _typed(node: ast.AST) -> str | None:
    """``x`` of ``type(x).__name__`` or ``x.__class__.__name__``."""
    if not (isinstance(node, ast.Attribute) and node.attr == "__name__"):
        return None
    inner = node.value
    if isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "type" and inner.args:
        inner = inner.args[0]
    elif isinstance(inner, ast.Attribute) and inner.attr == "__class__":
        inner = inner.value
    return inner.id if isinstance(inner, ast.Name) else None


def _one_line_copies(tree: ast.AST) -> list[int]:
    """Lines of f-strings that write a value's type and the value itself (an exception as
    ``Type: message``) by hand."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            values = [v.value for v in node.values if isinstance(v, ast.FormattedValue)]
            shown = {v.id for v in values if isinstance(v, ast.Name)}
            if any(_typed(v) in shown for v in values):
                found.append(node.lineno)
    return found


def test_an_exception_is_made_one_line_in_one_place() -> None:
    """``ppokit.errors.one_line`` is the one way an exception becomes a line of a message."""
    copies = []
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defs = [
            n.name
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.name.strip("_") in ("one_line", "first_line")
        ]
        if where != "ppokit/errors.py":
            copies += [f"{where}: def {name}" for name in defs]
            copies += [f"{where}:{line}" for line in _one_line_copies(tree)]
    assert not copies, f"use ppokit.errors.one_line: {copies}"
    probe = ast.parse('f"{type(exc).__name__}: {exc}"')
    assert _one_line_copies(probe) == [1]  # the pattern finds a copy


#: The modules of bounded calls (ppokit.bounded's docstring): the worker processes and the
#: deadline in this process.
BOUNDS = ("ppokit/bounded.py", "ppokit/workers.py")
#: What only they may use: futures waited for, process pools, the interval timer, the
#: watchdog that ends a process.
BOUND_MODULES = ("concurrent", "multiprocessing")
BOUND_CALLS = ("setitimer", "alarm", "dump_traceback_later")
#: The asynchronous schedule's generation thread: it waits on futures of its own, never
#: under a timeout (the one module besides BOUNDS that may import concurrent.futures).
SCHEDULE = "ppokit/trainer/producers/schedule.py"


def _bounds(tree: ast.AST, *, futures: bool = False) -> list[int]:
    """Lines that wait on a future or a process pool, or set a timer, outside BOUNDS
    (``futures``: the module may wait on futures, never under a timeout)."""
    found = []
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        allowed = ("concurrent.futures",) if futures else ()
        if any(m.split(".")[0] in BOUND_MODULES and m not in allowed for m in modules):
            found.append(node.lineno)
        if isinstance(node, ast.Attribute) and node.attr in BOUND_CALLS:
            found.append(node.lineno)
        if futures and isinstance(node, ast.keyword) and node.arg == "timeout":
            found.append(node.value.lineno)
    return found


def test_a_call_is_bounded_in_one_place() -> None:
    """``ppokit.bounded`` (with ``ppokit.workers``, its worker processes) is the one place a
    call is bounded: no other module waits on a future or a process of its own, or sets a
    timer; the asynchronous schedule waits on its generation thread's futures, without a
    timeout."""
    waiting = []
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(ROOT).as_posix()
        if where not in BOUNDS:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            waiting += [f"{where}:{line}" for line in _bounds(tree, futures=where == SCHEDULE)]
    assert not waiting
    probe = ast.parse("import concurrent.futures\nsignal.setitimer(0, 1)")
    assert _bounds(probe) == [1, 2]
    waited = ast.parse("from concurrent.futures import Future\nf.result(timeout=1)")
    assert _bounds(waited, futures=True) == [2] and _bounds(waited) == [1]


def _private_imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, ``module.name``) of each underscore name a module imports from a ppokit
    module (inside functions and TYPE_CHECKING blocks too)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        if base.split(".")[0] != "ppokit":
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append((node.lineno, f"{base}.{alias.name}"))
    return found


def test_no_module_imports_another_modules_underscore_names() -> None:
    """What a module offers is public and documented; what only it uses stays private."""
    crossing = []
    for path in PACKAGE.rglob("*.py"):
        if "templates" in path.relative_to(PACKAGE).parts:
            continue
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for line, imported in _private_imports(ast.parse(path.read_text()), package):
            crossing.append(f"{path.relative_to(ROOT)}:{line} {imported}")
    assert not crossing


def test_a_private_import_is_found() -> None:
    tree = ast.parse("from ppokit.a import _b, c\nfrom .d import _e\nimport os\n")
    assert _private_imports(tree, "ppokit.x") == [(1, "ppokit.a._b"), (2, "ppokit.x.d._e")]
