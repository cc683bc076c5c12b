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
    pytester.makeconftest(
        "from tests.mpi_plugin import pytest_pycollect_makemodule, pytest_report_header\n"
    )
    mpi = pytester.path / "suite" / "mpi"
    mpi.mkdir(parents=True)
    (mpi / "test_judged.py").write_text(
        textwrap.dedent(
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
            """
        )
    )
    env_path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    pytester._monkeypatch.setenv("PYTHONPATH", env_path)
    pytester._monkeypatch.delenv("JAXDDP_TEST_NP", raising=False)
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider", "suite/mpi")
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
