"""A background save still in flight when the program ends: waited for at exit, and a
failed one ends the job with status 1 and its reason on every rank."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.harness import launch

SCRIPT = str(Path(__file__).with_name("scripts") / "exit_with_save_in_flight.py")


def test_a_save_in_flight_at_exit_is_complete_after_the_job(tmp_path):
    directory = tmp_path / "ckpt"
    result = launch([SCRIPT, str(directory), "ok"], 2, timeout=90, quick=True)
    assert result.ok, result.report()
    assert sorted(os.listdir(directory)) == ["1"]
    import jax.numpy as jnp

    import jaxddp

    with jaxddp.CheckpointManager(directory) as ckpt:  # one process: checksums verified
        w = ckpt.restore(1, {"w": jnp.zeros((8 << 20,), jnp.float32)})["w"]
    np.testing.assert_array_equal(np.asarray(w[:5]), np.ones(5, np.float32))


@pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs root")
def test_a_save_that_fails_in_flight_at_exit_ends_the_job_with_its_reason(tmp_path):
    directory = tmp_path / "ckpt"
    try:
        result = launch([SCRIPT, str(directory), "fail"], 2, timeout=90, quick=True)
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=False)
    assert not result.timed_out, result.report()
    assert result.returncode != 0, result.report()
    for r in ("0", "1"):
        assert f"rank {r} leaves with save 2 in flight" in result.rank_logs[r]
        assert "Could not save checkpoint 2" in result.rank_logs[r], result.report()
    assert sorted(os.listdir(directory)) == ["1"]
