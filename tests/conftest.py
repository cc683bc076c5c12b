"""Settings for the whole suite, and the plugin that runs tests/mpi as real ranks."""

import os
import shutil
import tempfile

import pytest
from hypothesis import settings

# The CPU unless the run names another platform (the GPU check runs tests/mpi with
# JAX_PLATFORMS=cuda, tests/gpu/run.sh); the launches pass it on to the ranks. On a GPU, float32
# matrix products in full precision: the tests compare W ranks with one process to 1e-6,
# which TF32's 10-bit mantissa does not reach (tests/gpu/exact.py measures both).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if any(p in os.environ["JAX_PLATFORMS"] for p in ("cuda", "gpu")):
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")

# No deadline per Hypothesis example: on two cores shared with ranks and other workers one
# example of a few milliseconds took 297 ms (test_launcher.py, 200 ms deadline) and failed a
# run. The suite proves behaviour; speed is benchmarks/' business.
settings.register_profile("jaxddp", deadline=None)
settings.load_profile("jaxddp")

from tests.harness import COMPILE_CACHE_VARIABLE, RANK_RUN_VARIABLE, switches
from tests.mpi_plugin import pytest_configure as mpi_configure
from tests.mpi_plugin import (
    pytest_pycollect_makemodule,
    pytest_report_header,
    pytest_runtest_logfinish,
    pytest_runtest_logreport,
    pytest_runtest_logstart,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_warning_recorded,
)

# The suite's switches of jaxddp's internals (JAXDDP_TEST_CUDA_DRIVER, JAXDDP_TEST_STAGED,
# JAXDDP_TEST_COLLECTIVE_PATH), which the package never reads: set as their modules are
# imported, before any test imports jaxddp (tests/harness/switches.py).
switches.install()

# The compilation cache folder this pytest process made (and removes at its end).
_made_cache: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    mpi_configure(config)
    if not os.environ.get(RANK_RUN_VARIABLE) and not os.environ.get(COMPILE_CACHE_VARIABLE):
        # Every launch of this pytest run shares JAX's compilation cache (tests/harness:
        # COMPILE_CACHE_VARIABLE): the xdist workers and any pytest run in a subprocess
        # inherit the folder that the first pytest process made.
        _made_cache.append(tempfile.mkdtemp(prefix="jaxddp-compile-cache-"))
        os.environ[COMPILE_CACHE_VARIABLE] = _made_cache[0]


def pytest_unconfigure(config: pytest.Config) -> None:
    while _made_cache:
        os.environ.pop(COMPILE_CACHE_VARIABLE, None)
        shutil.rmtree(_made_cache.pop(), ignore_errors=True)


# -- parallel runs (``pytest -n 3``, as ``nox -s tests`` runs the suite) ---------------------
#
# One worker makes each launch of tests/mpi and runs all of its items (their ids end in the
# launch's tag, e.g. ``[np=4]``), and one worker runs each module whose tests share launches
# through module-scoped fixtures (SHARED_LAUNCHES). Every other test is scheduled on its
# own. The heaviest go first, so that no worker starts a long one near the end: the seconds
# are what each took on its own on the 2-core machine (2026-12-01, serial run); only their
# order matters.
SHARED_LAUNCHES = {
    "test_docs_examples.py": 250,
    "test_examples.py": 200,
    "test_checkpoint_resume.py": 190,
    "test_harness.py": 75,
    "test_launcher_launches.py": 60,
    "test_startup.py": 30,
}
# Tests of other modules that share one launch through a module-scoped fixture: one worker
# runs each group. Every other test is scheduled on its own.
SHARED_LAUNCH_TESTS = {
    "tests/test_stall.py healthy": (
        "tests/test_stall.py::test_a_slow_but_progressing_rank_gets_no_report",
        "tests/test_stall.py::test_a_loop_of_jitted_steps_alone_gets_no_report",
        "tests/test_stall.py::test_a_caught_sys_exit_followed_by_more_work_is_not_an_exit",
    ),
}
SHARED_LAUNCH_GROUP = {
    test: group for group, tests in SHARED_LAUNCH_TESTS.items() for test in tests
}
MPI_MODULE_SECONDS = 6  # one tests/mpi module on one rank, roughly: a launch ~ ranks x modules
SLOW_TEST_SECONDS = 10  # a test that launches a job of its own


def xdist_scope(nodeid: str) -> str:
    """What one worker runs together: a launch of tests/mpi, a module of SHARED_LAUNCHES, a
    group of SHARED_LAUNCH_TESTS, or the test alone."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/mpi/") and nodeid.endswith("]"):
        return "mpi " + nodeid[nodeid.rindex("[") :]
    if path.rpartition("/")[2] in SHARED_LAUNCHES:
        return path
    return SHARED_LAUNCH_GROUP.get(nodeid, nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    # pytest-xdist's own ``--dist loadgroup`` no longer groups on pytest 9.2 (it rewrites an
    # attribute the node id is not read from any more), so the grouping is ours.
    from xdist.scheduler import LoadScopeScheduling

    class LaunchScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return LaunchScheduling(config, log)


def _seconds(item: pytest.Item) -> float:
    run = getattr(item, "mpi_run", None)
    if run is not None:
        return run.np * len(run.paths) * MPI_MODULE_SECONDS
    if item.path.name in SHARED_LAUNCHES:
        return SHARED_LAUNCHES[item.path.name]
    return SLOW_TEST_SECONDS if item.get_closest_marker("slow") else 0.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get(RANK_RUN_VARIABLE):
        items.sort(key=_seconds, reverse=True)  # stable: a module's tests keep their order


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    """With ``--doctest-modules`` over ``tests`` (one run for the whole suite), the modules
    of tests/mpi are not imported here for doctests: they hold none, and they are meant to be
    imported on the ranks only."""
    collected = yield
    if file_path.parent.name == "mpi" and file_path.parent.parent.name == "tests":
        return [c for c in collected if type(c).__name__ != "DoctestModule"]
    return collected


# Scripts that tests launch on real ranks, and recorded data: never collected (with
# --doctest-modules pytest would import the scripts, and they run at import).
collect_ignore = ["scripts", "data"]

__all__ = [
    "pytest_configure",
    "pytest_pycollect_makemodule",
    "pytest_report_header",
    "pytest_runtest_logfinish",
    "pytest_runtest_logreport",
    "pytest_runtest_logstart",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
    "pytest_unconfigure",
    "pytest_warning_recorded",
]
