"""Deadlocks turned into errors, on real launches: the fail-fast abort and the tree check."""

import os
from pathlib import Path

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow  # real launches, one waiting for the watchdog on purpose

SCRIPTS = Path(__file__).with_name("scripts")


def test_a_rank_that_raises_ends_the_whole_job():
    result = launch([str(SCRIPTS / "raise_mid_training.py")], 2, timeout=60, quick=True)
    assert not result.timed_out, result.report()
    assert result.returncode != 0
    assert result.after_first_text < 30, result.report()  # their start not counted
    log = result.rank_logs["1"]
    assert "Traceback" in log
    assert "RuntimeError: boom at step 3" in log
    assert "aborting every rank" in log


def test_without_the_abort_the_same_job_hangs():
    env = dict(os.environ, JAXDDP_ABORT_ON_ERROR="0")
    # Ended 10 s after the last line (rank 1's traceback): the ranks may take 100 s to start.
    result = launch(
        [str(SCRIPTS / "raise_mid_training.py")],
        2,
        timeout=120,
        quiet=10,
        start=100,
        env=env,
        quick=True,
    )
    assert result.timed_out, result.report()
    assert result.elapsed < 100, result.report()  # by the quiet limit, not the backstop
    assert "deadlock suspected" in result.report()
    assert "boom at step 3" in result.rank_logs["1"]


def test_a_rank_missing_from_the_check_is_an_error_not_a_hang():
    env = dict(os.environ, JAXDDP_CHECK_TIMEOUT="3")
    result = launch([str(SCRIPTS / "check_timeout.py")], 2, timeout=60, env=env, quick=True)
    assert not result.timed_out, result.report()
    assert result.returncode != 0
    assert result.after_first_text < 30, result.report()  # their start not counted
    assert "TimeoutError: Rank 0 waited 3 s" in result.rank_logs["0"]  # as the guide says
    assert "not every rank arrived" in result.rank_logs["0"]


def test_a_rank_that_never_builds_its_sampler_is_an_error_within_the_deadline():
    env = dict(os.environ, JAXDDP_CHECK_TIMEOUT="3")
    result = launch([str(SCRIPTS / "sampler_timeout.py")], 2, timeout=60, env=env, quick=True)
    assert not result.timed_out, result.report()
    assert result.returncode != 0
    assert result.after_first_text < 30, result.report()  # their start not counted
    log = " ".join(result.rank_logs["0"].split())
    assert "rank 1 never builds its sampler" in result.rank_logs["1"]
    assert "TimeoutError: Rank 0 waited 3 s in jaxddp's check of the arguments of " in log
    assert "`DistributedSampler` and not every rank arrived" in log
    waited = float(log.split("rank 0 raised after ")[1].split(" s:")[0])
    assert 3 <= waited < 10, log


@pytest.mark.parametrize("path", ["mpi", "xla"])
def test_sigterm_ends_a_rank_or_runs_the_programs_handler_on_both_paths(path):
    # Before the fix, JAX's preemption service (started with its distributed runtime on the
    # xla path) took SIGTERM over: both ranks logged "SIGTERM caught", rank 0's own handler
    # never ran, and the job trained on to its last step and exited 0.
    env = dict(os.environ, JAXDDP_COLLECTIVES=path)
    result = launch([str(SCRIPTS / "sigterm.py")], 2, timeout=90, env=env, quick=True)
    assert not result.timed_out, result.report()
    assert result.returncode != 0, result.report()
    assert result.after_first_text < 30, result.report()  # their start not counted
    assert "rank 0's own handler caught SIGTERM at step 3" in result.rank_logs["0"]
    assert "rank 1 sends itself SIGTERM at step 6" in result.rank_logs["1"]
    assert "ran all steps" not in result.rank_logs["0"] + result.rank_logs["1"]
