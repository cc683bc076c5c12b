"""The MPI test harness is itself tested: a hang becomes a failure with stacks, a bad exit
code is reported, and the plugin judges each test by every rank's own result.

The plugin's tests run small tests/mpi modules through a pytest of their own, in a
subprocess; the modules of one scenario share that run, and (at one world size) one launch,
as the suite's own do.
"""

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import QUICK_ENV, QUICK_XLA_FLAGS, launch, quick_env

pytestmark = pytest.mark.slow  # real launches, some waiting for the watchdog on purpose

SCRIPTS = Path(__file__).with_name("scripts")
ROOT = Path(__file__).parents[1]


def test_watchdog_turns_a_hang_into_a_failure_with_stacks():
    # Ended 8 s after the ranks' last line, however long they took to start.
    result = launch([str(SCRIPTS / "hang.py")], 2, timeout=120, quiet=8, start=100)
    assert result.timed_out
    assert not result.ok
    assert result.elapsed < 100  # by the quiet limit, not the backstop
    assert result.first_text is not None  # their lines
    assert 8 <= result.after_first_text < 30, result.report()  # and the quiet 8 s after
    report = result.report()
    assert "deadlock suspected" in report
    assert set(result.rank_logs) == {"0", "1"}
    # every rank's Python stack, from inside the hang
    assert "wait_for_the_others" in result.rank_logs["0"]
    assert "never_joins" in result.rank_logs["1"]
    assert "most recent call first" in report


def test_a_rank_exiting_3_is_reported_as_a_failure():
    result = launch([str(SCRIPTS / "exit_code.py"), "3"], 2, timeout=60)
    assert not result.timed_out
    assert result.returncode != 0
    assert not result.ok
    assert result.rank_exits == {"0": 0, "1": 3}
    assert result.failed_ranks() == ["1"]
    report = result.report()
    assert "rank 1: 3" in report
    assert "rank 1 leaving early" in report


def test_a_clean_launch_is_ok():
    result = launch([str(SCRIPTS / "exit_code.py"), "0"], 2, timeout=60)
    assert result.ok, result.report()
    assert result.rank_exits == {"0": 0, "1": 0}


def test_a_quick_launch_keeps_the_tests_own_settings_and_can_keep_llvm_optimizations():
    base = {"PATH": "/bin", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    quick = quick_env(base)
    assert quick["XLA_FLAGS"].split() == [QUICK_XLA_FLAGS, "--xla_dump_to=/tmp/x"]
    assert quick["PATH"] == "/bin"
    assert all(quick[k] == v for k, v in QUICK_ENV.items())
    assert base["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"  # the caller's dict is left alone
    assert quick_env({})["XLA_FLAGS"] == QUICK_XLA_FLAGS
    optimized = quick_env(base, optimized=True)
    assert optimized["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    assert "XLA_FLAGS" not in quick_env({}, optimized=True)


@dataclass
class Suite:
    out: pytest.LineMatcher  # what that pytest printed
    returncode: int
    directory: Path  # where its ranks ran


def _run_modules(directory: Path, sources: dict[str, str], **env: str) -> Suite:
    """Runs modules as DIRECTORY/suite/mpi/NAME (name -> source) through the project's
    plugin in a pytest of their own, with the variables ``env`` set. The ranks run in
    DIRECTORY."""
    (directory / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (directory / "tox.ini").write_text(  # as the project's: every warning is an error
        "[pytest]\nfilterwarnings =\n    error\n    ignore::DeprecationWarning:jax.*\n"
    )
    mpi = directory / "suite" / "mpi"
    mpi.mkdir(parents=True)
    for name, source in sources.items():
        (mpi / name).write_text(textwrap.dedent(source))
    full = {k: v for k, v in os.environ.items() if k != "JAXDDP_TEST_NP"}
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    full.update(env)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "suite/mpi"],
        cwd=directory,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = pytest.LineMatcher((done.stdout + done.stderr).splitlines())
    return Suite(out, done.returncode, directory)


JUDGED = """
    import pytest
    import jaxddp

    MPI_SIZES = (2,)
    rank = jaxddp.rank()

    def test_passes_everywhere():
        assert jaxddp.world_size() == 2

    def test_fails_on_rank_1():
        assert rank != 1, "rank 1 disagrees"

    def test_skipped_on_rank_0_only():
        if rank == 0:
            pytest.skip("only here")

    @pytest.mark.skip(reason="everywhere")
    def test_skipped_everywhere():
        pass
    """

# pytest reports a thread's exception as an error of whichever phase notices it, on that rank
# alone: here the setup of a test whose body holds a collective, which the other rank would
# then wait in forever. The harness reports it at the end instead.
THREAD = """
    import threading
    import pytest
    from mpi4py import MPI
    import jaxddp

    MPI_SIZES = (2,)
    rank = jaxddp.rank()

    def fail():
        raise ZeroDivisionError("a thread on rank 1 failed")

    @pytest.fixture
    def thread_failing_on_rank_1():
        if rank == 1:
            t = threading.Thread(target=fail)
            t.start()
            t.join()

    def test_a_collective_after_a_failed_thread(thread_failing_on_rank_1):
        assert MPI.COMM_WORLD.allreduce(rank) == 1

    def test_the_next_collective():
        assert MPI.COMM_WORLD.allreduce(1) == 2
    """

# As from a third-party finalizer the garbage collector runs at a random moment: the thread's
# frames are all in the standard library.
ELSEWHERE = """
    import threading
    from mpi4py import MPI
    import jaxddp

    MPI_SIZES = (2,)

    def test_a_thread_fails_in_the_standard_library_on_rank_1():
        if jaxddp.rank() == 1:
            t = threading.Thread(target=int, args=("not a number",))
            t.start()
            t.join()
        assert MPI.COMM_WORLD.allreduce(1) == 2
    """


@pytest.fixture(scope="module")
def judged(tmp_path_factory) -> Suite:
    """The three modules above, in one launch at 2 ranks."""
    return _run_modules(
        tmp_path_factory.mktemp("judged"),
        {"test_judged.py": JUDGED, "test_thread.py": THREAD, "test_elsewhere.py": ELSEWHERE},
        JAXDDP_TEST_TIMEOUT="30",
    )


def test_plugin_judges_every_test_by_every_rank(judged):
    """A module with a passing test, one failing on rank 1 only, one skipped on rank 0 only."""
    judged.out.fnmatch_lines(
        [
            "*test_judged.py::[[]np=2[]] PASSED*",
            "*test_passes_everywhere[[]np=2[]] PASSED*",
            "*test_fails_on_rank_1[[]np=2[]] FAILED*",
            "*test_skipped_on_rank_0_only[[]np=2[]] FAILED*",
            "*test_skipped_everywhere[[]np=2[]] SKIPPED*",
        ]
    )
    judged.out.fnmatch_lines(["*rank 1 disagrees*"])
    judged.out.fnmatch_lines(["*skipped on some ranks only*"])
    assert judged.returncode != 0


def test_an_exception_in_a_thread_on_one_rank_fails_the_launch_without_a_hang(judged):
    """Blamed on its own module's launch item, although other modules of the launch failed."""
    judged.out.fnmatch_lines(
        [
            "*test_thread.py::[[]np=2[]] FAILED*",
            "*test_a_collective_after_a_failed_thread[[]np=2[]] PASSED*",
            "*test_the_next_collective[[]np=2[]] PASSED*",
        ]
    )
    judged.out.fnmatch_lines(["*exceptions in threads or finalizers on this rank*"])
    judged.out.fnmatch_lines(["*a thread on rank 1 failed*"])
    assert "deadlock suspected" not in judged.out.str()


def test_an_exception_raised_outside_our_code_in_a_thread_is_only_logged(judged):
    judged.out.fnmatch_lines(
        [
            "*test_elsewhere.py::[[]np=2[]] PASSED*",
            "*test_a_thread_fails_in_the_standard_library_on_rank_1[[]np=2[]] PASSED*",
        ]
    )


PIDS = """
    import os
    from mpi4py import MPI
    import jaxddp

    MPI_SIZES = (2,)

    def test_one_launch_for_all():
        pids = MPI.COMM_WORLD.allgather(os.getpid())
        if jaxddp.rank() == 0:  # the ranks run in the suite's folder
            with open("pids.txt", "a") as f:
                f.write(" ".join(map(str, pids)) + "\\n")
    """

LEFT = """
    def test_rank_1_fails_before_a_collective():
        assert jaxddp.rank() != 1, "rank 1 left before the barrier"
        MPI.COMM_WORLD.Barrier()

    def test_rank_1_is_elsewhere():
        MPI.COMM_WORLD.bcast(None)
    """


@pytest.fixture(scope="module")
def hung(tmp_path_factory) -> Suite:
    """Three modules at 2 ranks, one launch: the third hangs."""
    directory = tmp_path_factory.mktemp("hung")
    second = (
        PIDS
        + """
    def test_fails_on_both_ranks():
        assert MPI.COMM_WORLD.allreduce(1) == 3, "two ranks, not three"
    """
    )
    sources = {"test_first.py": PIDS, "test_second.py": second, "test_third.py": PIDS + LEFT}
    return _run_modules(directory, sources, JAXDDP_TEST_TIMEOUT="20", JAXDDP_STALL_WARN="0")


def test_a_hang_after_a_failure_on_one_rank_shows_that_failure(hung):
    out = hung.out
    out.fnmatch_lines(["*deadlock suspected*"])
    out.fnmatch_lines(["*test_rank_1_fails_before_a_collective failed in call on this rank*"])
    out.fnmatch_lines(["*rank 1 left before the barrier*"])


def test_modules_of_one_world_size_share_a_launch_and_a_hang_is_blamed_on_its_test(hung):
    """The ranks report one pid each across all three modules. The third hangs in its last
    test; the first two keep their results (one passed, one failed), and the hang's report
    names the test each rank was in."""
    out = hung.out
    out.fnmatch_lines(
        [
            "*test_first.py::[[]np=2[]] PASSED*",
            "*test_first.py::test_one_launch_for_all[[]np=2[]] PASSED*",
            "*test_second.py::[[]np=2[]] PASSED*",
            "*test_second.py::test_one_launch_for_all[[]np=2[]] PASSED*",
            "*test_second.py::test_fails_on_both_ranks[[]np=2[]] FAILED*",
            "*test_third.py::[[]np=2[]] FAILED*",
            "*test_third.py::test_one_launch_for_all[[]np=2[]] PASSED*",
            "*test_third.py::test_rank_1_fails_before_a_collective[[]np=2[]] FAILED*",
            "*test_third.py::test_rank_1_is_elsewhere[[]np=2[]] FAILED*",
        ]
    )
    out.fnmatch_lines(["*two ranks, not three*"])
    stopped = (
        "*the launch stopped with rank 0 in test_third.py::test_rank_1_fails_before_a_collective,"
        " rank 1 in test_third.py::test_rank_1_is_elsewhere*"
    )
    out.fnmatch_lines([stopped])
    lines = (hung.directory / "pids.txt").read_text().splitlines()
    assert len(lines) == 3, lines
    assert len(set(lines)) == 1, lines  # the same two processes in all three modules
