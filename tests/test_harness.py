"""The MPI test harness is itself tested: a hang becomes a failure with stacks, a bad exit
code is reported, and the plugin judges each test by every rank's own result."""

import os
import textwrap
from pathlib import Path

from tests.harness import launch

SCRIPTS = Path(__file__).with_name("scripts")
ROOT = Path(__file__).parents[1]


def test_watchdog_turns_a_hang_into_a_failure_with_stacks():
    result = launch([str(SCRIPTS / "hang.py")], 2, timeout=15)
    assert result.timed_out
    assert not result.ok
    assert result.elapsed < 30
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


def test_plugin_judges_every_test_by_every_rank(pytester):
    """A module with a passing test, one failing on rank 1 only, one skipped on rank 0 only."""
    result = _run_module(
        pytester,
        "test_judged.py",
        """
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
        """,
    )
    result.stdout.fnmatch_lines(
        [
            "*test_judged.py::[[]np=2[]] PASSED*",
            "*test_passes_everywhere[[]np=2[]] PASSED*",
            "*test_fails_on_rank_1[[]np=2[]] FAILED*",
            "*test_skipped_on_rank_0_only[[]np=2[]] FAILED*",
            "*test_skipped_everywhere[[]np=2[]] SKIPPED*",
        ]
    )
    result.stdout.fnmatch_lines(["*rank 1 disagrees*"])
    result.stdout.fnmatch_lines(["*skipped on some ranks only*"])
    assert result.ret != 0


def _run_module(pytester, name: str, source: str, **env: str):
    """Runs one module as tests/mpi/NAME through the project's plugin, with the variables
    ``env`` set; returns pytester's result."""
    return _run_modules(pytester, {name: source}, **env)


def _run_modules(pytester, sources: dict[str, str], **env: str):
    """Runs modules as tests/mpi/NAME (name -> source) through the project's plugin, with
    the variables ``env`` set; returns pytester's result."""
    pytester.makeconftest("from tests.conftest import *  # noqa: F403\n")
    pytester.makeini(  # as the project's: every warning is an error
        "[pytest]\nfilterwarnings =\n    error\n    ignore::DeprecationWarning:jax.*\n"
    )
    mpi = pytester.path / "suite" / "mpi"
    mpi.mkdir(parents=True)
    for name, source in sources.items():
        (mpi / name).write_text(textwrap.dedent(source))
    env_path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    pytester._monkeypatch.setenv("PYTHONPATH", env_path)
    pytester._monkeypatch.delenv("JAXDDP_TEST_NP", raising=False)
    for variable, value in env.items():
        pytester._monkeypatch.setenv(variable, value)
    return pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider", "suite/mpi")


def test_an_exception_in_a_thread_on_one_rank_fails_the_launch_without_a_hang(pytester):
    """pytest reports a thread's exception as an error of whichever phase notices it, on
    that rank alone: here the setup of a test whose body holds a collective, which the
    other rank would then wait in forever. The harness reports it at the end instead."""
    result = _run_module(
        pytester,
        "test_thread.py",
        """
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
        """,
        JAXDDP_TEST_TIMEOUT="30",
    )
    result.stdout.fnmatch_lines(
        [
            "*test_thread.py::[[]np=2[]] FAILED*",
            "*test_a_collective_after_a_failed_thread[[]np=2[]] PASSED*",
            "*test_the_next_collective[[]np=2[]] PASSED*",
        ]
    )
    result.stdout.fnmatch_lines(["*exceptions in threads or finalizers on this rank*"])
    result.stdout.fnmatch_lines(["*a thread on rank 1 failed*"])
    assert "deadlock suspected" not in result.stdout.str()


def test_an_exception_raised_outside_our_code_in_a_thread_is_only_logged(pytester):
    """As from a third-party finalizer the garbage collector runs at a random moment: the
    thread's frames are all in the standard library."""
    result = _run_module(
        pytester,
        "test_elsewhere.py",
        """
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
        """,
        JAXDDP_TEST_TIMEOUT="30",
    )
    result.stdout.fnmatch_lines(
        [
            "*test_elsewhere.py::[[]np=2[]] PASSED*",
            "*test_a_thread_fails_in_the_standard_library_on_rank_1[[]np=2[]] PASSED*",
        ]
    )
    assert result.ret == 0


def test_a_hang_after_a_failure_on_one_rank_shows_that_failure(pytester):
    result = _run_module(
        pytester,
        "test_left.py",
        """
        from mpi4py import MPI
        import jaxddp

        MPI_SIZES = (2,)

        def test_rank_1_fails_before_a_collective():
            assert jaxddp.rank() != 1, "rank 1 left before the barrier"
            MPI.COMM_WORLD.Barrier()

        def test_rank_1_is_elsewhere():
            MPI.COMM_WORLD.bcast(None)
        """,
        JAXDDP_TEST_TIMEOUT="20",
        JAXDDP_STALL_WARN="0",
    )
    result.stdout.fnmatch_lines(["*deadlock suspected*"])
    result.stdout.fnmatch_lines(
        ["*test_rank_1_fails_before_a_collective failed in call on this rank*"]
    )
    result.stdout.fnmatch_lines(["*rank 1 left before the barrier*"])


def test_modules_of_one_world_size_share_a_launch_and_a_hang_is_blamed_on_its_test(pytester):
    """Three modules at 2 ranks are one launch: the ranks report one pid each across all
    three. The third hangs in its second test; the first two keep their results (one passed,
    one failed), and the hang's report names the test each rank was in."""
    pid = """
        import os
        from mpi4py import MPI
        import jaxddp

        MPI_SIZES = (2,)

        def test_one_launch_for_all():
            pids = MPI.COMM_WORLD.allgather(os.getpid())
            if jaxddp.rank() == 0:  # the ranks run in pytester's folder
                with open("pids.txt", "a") as f:
                    f.write(" ".join(map(str, pids)) + "\\n")
        """
    result = _run_modules(
        pytester,
        {
            "test_first.py": pid,
            "test_second.py": pid
            + """
        def test_fails_on_both_ranks():
            assert MPI.COMM_WORLD.allreduce(1) == 3, "two ranks, not three"
        """,
            "test_third.py": pid
            + """
        def test_rank_1_never_joins():
            if jaxddp.rank() == 0:
                MPI.COMM_WORLD.Barrier()
        """,
        },
        JAXDDP_TEST_TIMEOUT="20",
        JAXDDP_STALL_WARN="0",
    )
    result.stdout.fnmatch_lines(
        [
            "*test_first.py::[[]np=2[]] PASSED*",
            "*test_first.py::test_one_launch_for_all[[]np=2[]] PASSED*",
            "*test_second.py::[[]np=2[]] PASSED*",
            "*test_second.py::test_one_launch_for_all[[]np=2[]] PASSED*",
            "*test_second.py::test_fails_on_both_ranks[[]np=2[]] FAILED*",
            "*test_third.py::[[]np=2[]] FAILED*",
            "*test_third.py::test_one_launch_for_all[[]np=2[]] PASSED*",
            "*test_third.py::test_rank_1_never_joins[[]np=2[]] FAILED*",
        ]
    )
    result.stdout.fnmatch_lines(["*two ranks, not three*"])
    result.stdout.fnmatch_lines(["*deadlock suspected*"])
    result.stdout.fnmatch_lines(
        ["*the launch stopped with rank 0 in test_third.py::test_rank_1_never_joins*"]
    )
    lines = (pytester.path / "pids.txt").read_text().splitlines()
    assert len(lines) == 3, lines
    assert len(set(lines)) == 1, lines  # the same two processes in all three modules
