"""The deadlock of naively sharded data reproduced on 2 real ranks, and its fix.

Sharding N = 7 naively gives rank 1 one batch fewer; with one allreduce per batch, rank 0
waits forever for it. The watchdog catches that (the expected outcome here); the same loop
over ``DistributedSampler.batches`` finishes on both ranks.
"""

from pathlib import Path

import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow  # real launches, one waiting for the watchdog on purpose

SCRIPT = Path(__file__).with_name("scripts") / "naive_shards.py"


def test_naive_shards_deadlock_and_the_watchdog_catches_it():
    result = launch([str(SCRIPT), "naive"], 2, timeout=30, quick=True)
    report = result.report()
    assert result.timed_out, report
    assert "deadlock suspected" in report
    # rank 1 ran out of batches and left; rank 0 is stuck inside its fourth step
    assert "rank 1 finished after 3 batches" in result.rank_logs["1"], report
    assert "finished" not in result.rank_logs["0"], report
    assert "in run_step" in result.rank_logs["0"], report


def test_the_same_loop_over_the_sampler_finishes():
    result = launch([str(SCRIPT), "sampler"], 2, timeout=90, quick=True)
    assert result.ok, result.report()
    for r in ("0", "1"):
        assert f"rank {r} finished after 4 batches: count 7, sum 28.0" in result.rank_logs[r]
