"""``import jaxddp`` leaves MPI as ``from mpi4py import MPI`` would: the program's own mpi4py
code works, with no launcher and on 2 real ranks under mpiexec.

Each scenario runs ``tests/scripts/startup.py``; every rank's printed values are checked, not
just the exit code. Scenarios that begin with ``import jaxddp`` and only add to it (SHARED)
run one after the other in one process (and one launch), each checked from its own lines;
every other scenario meets a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow  # a fresh process or launch per scenario, each paying JAX's import

SCRIPT = Path(__file__).with_name("scripts") / "startup.py"
SKIP = "JAXDDP_SKIP_LAUNCHER_CHECK"
# `import jaxddp`, then the program's mpi4py; then its own first `import mpi4jax`; then
# mpi4py's own benchmark: each only adds to what the one before it imported
SHARED = ("import-then-mpi4py", "mpi4jax-after", "mpi4py-bench")


def run(scenario: str, np: int) -> dict[int, str]:
    """Each rank's output: under ``mpiexec -n np``, or as one process with no launcher (np=0).
    A scenario of SHARED: the output of the run of all of SHARED, made once per ``np``."""
    if scenario in SHARED:
        if np not in _shared:
            _shared[np] = _run(SHARED, np)
        return _shared[np]
    return _run((scenario,), np)


_shared: dict[int, dict[int, str]] = {}


def _run(scenarios: tuple[str, ...], np: int) -> dict[int, str]:
    env = {k: v for k, v in os.environ.items() if k != SKIP}
    if np == 0:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *scenarios],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return {0: done.stdout}
    result = launch([str(SCRIPT), *scenarios], np, timeout=120, env=env)
    assert result.ok, result.report()
    return {int(r): log for r, log in result.rank_logs.items()}


@pytest.fixture(params=[0, 2], ids=["no-launcher", "mpiexec-2"])
def np(request) -> int:
    return request.param


def size_of(np: int) -> int:
    return max(np, 1)


def test_import_jaxddp_then_use_mpi4py(np):
    size = size_of(np)
    logs = run("import-then-mpi4py", np)
    assert sorted(logs) == list(range(size))
    total = size * (size + 1) // 2
    for rank, log in logs.items():
        assert f"initialized=True multiple=True rank={rank} size={size}" in log, log
        assert f"mpi4py allreduce={total} jaxddp rank={rank} size={size}" in log, log


def test_mpi4py_first_then_jaxddp_allreduce(np):
    size = size_of(np)
    total = size * (size + 1) // 2
    for rank, log in run("mpi4py-first", np).items():
        expected = f"rank={rank} size={size} mpi4py allreduce={total} jaxddp allreduce={total}"
        assert expected in log, log


def test_rc_initialize_false_keeps_mpi_uninitialized_until_first_use(np):
    size = size_of(np)
    total = size * (size + 1) // 2
    for rank, log in run("rc-initialize-false", np).items():
        assert "after import: initialized=False" in log, log
        assert (
            f"after first use: initialized=True rank={rank} size={size} jaxddp allreduce={total}"
            in log
        ), log


def test_mpi4py_bench_helloworld_after_import_jaxddp(np):
    size = size_of(np)
    for rank, log in run("mpi4py-bench", np).items():
        assert f"Hello, World! I am process {rank} of {size} on" in log, log


@pytest.mark.parametrize("when", ["before", "after"])
def test_mpi4jax_imported_by_the_program(np, when):
    size = size_of(np)
    total = float(size * (size + 1) // 2)
    for rank, log in run(f"mpi4jax-{when}", np).items():
        expected = (
            f"rank={rank} size={size} mpi4jax allreduce={[total, total]} "
            f"jaxddp allreduce={[total, total]}"
        )
        assert expected in log, log


def test_xla_collectives_after_jax_made_its_devices_are_refused_on_every_rank():
    outputs = run("xla-late", 2)
    for log in outputs.values():
        assert (
            "refused: JAXDDP_COLLECTIVES=xla: JAX had already made its devices on rank(s) 0, 1 "
            "before jaxddp could start JAX's distributed runtime" in log
        ), outputs


def test_a_bad_setting_is_named_at_import():
    env = dict(os.environ, JAXDDP_SKIP_LAUNCHER_CHECK="maybe")
    done = subprocess.run(
        [sys.executable, "-c", "import jaxddp"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 1
    assert (
        "SettingError: JAXDDP_SKIP_LAUNCHER_CHECK='maybe' is not a value jaxddp understands: "
        "expected a boolean, or `all`" in done.stderr
    ), done.stderr
