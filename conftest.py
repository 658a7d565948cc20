"""Hypothesis profiles for every test of the repository (the core's and the bundled plugins').

``ppokit`` (the default): each property test draws the same examples on every machine and
every run (``derandomize``: the seed is a hash of the test), so the README's test command
tests what CI tested; a failure prints the example and a ``@reproduce_failure`` blob.
``explore`` (``pytest --hypothesis-profile=explore``, with ``--hypothesis-seed=N`` to repeat a
run): fresh random examples each run, to look for inputs the fixed ones miss.

``pytest -n auto`` (pyproject's addopts: pytest-xdist) runs a worker per core, at most
:data:`MAX_WORKERS` and one per :data:`GIB_PER_WORKER` GiB of memory: an end-to-end test
starts processes and models of its own (two ranks, a vLLM engine), so more workers than that
only contend. ``-n 0`` runs the suite in one process.

Each worker's torch pool has a thread per core, so the workers' OpenMP threads outnumber the
cores; an OpenMP thread that spins while it waits for work takes the core another worker's
test needs. :data:`OMP_WAIT_POLICY` makes them sleep instead (set before any test imports
torch; a caller's own setting wins).

With ``PPOKIT_REQUIRE_EXTRAS=1`` (``.ci/run`` sets it: every optional package is installed
there) a test skipped because a package could not be imported fails instead
(:func:`missing_package_fails`), so an install step the README's test command lost cannot
pass as green.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

#: How the tests' OpenMP threads wait (libgomp reads it when torch is first imported).
OMP_WAIT_POLICY = "PASSIVE"
os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)

#: The most workers ``-n auto`` starts.
MAX_WORKERS = 4
#: The memory a worker may need at its peak (a test's vLLM engine or two ranks beside it).
GIB_PER_WORKER = 6


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores or 1, MAX_WORKERS, int(memory // GIB_PER_WORKER)))


settings.register_profile("ppokit", derandomize=True, print_blob=True, database=None)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("ppokit")


def missing_package_fails(report: pytest.CollectReport | pytest.TestReport) -> None:
    """With ``PPOKIT_REQUIRE_EXTRAS=1``, a skip for a package that could not be imported
    becomes a failure."""
    if os.environ.get("PPOKIT_REQUIRE_EXTRAS") != "1" or not report.skipped:
        return
    longrepr = report.longrepr
    reason = str(longrepr[-1]) if isinstance(longrepr, tuple) else str(longrepr)
    if "could not import" in reason:
        report.outcome = "failed"
        report.longrepr = f"PPOKIT_REQUIRE_EXTRAS=1, yet a test skipped: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    missing_package_fails(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    missing_package_fails(outcome.get_result())
