"""A background save still in flight when the program ends: waited for at exit, and a
failed one ends the job with status 1 and its reason on every rank."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness import launch

SCRIPT = str(Path(__file__).with_name("scripts") / "exit_with_save_in_flight.py")


@pytest.mark.skipif(sys.version_info[:2] == (3, 12), reason="Python 3.12: see the next test")
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


@pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="Python 3.12 alone")
def test_on_python_3_12_a_save_in_flight_at_exit_is_an_error_that_says_what_to_do(tmp_path):
    # Python 3.12 starts no thread once the interpreter began to exit (3.11 and 3.13 do), and
    # Orbax's write needs some: the save cannot finish there, so the job must say so
    directory = tmp_path / "ckpt"
    result = launch([SCRIPT, str(directory), "ok"], 2, timeout=90, quick=True)
    assert not result.timed_out, result.report()
    assert result.returncode != 0, result.report()
    for r in ("0", "1"):
        assert "Could not save checkpoint 1" in result.rank_logs[r], result.report()
        assert "Call the manager's close() or wait_until_finished()" in result.rank_logs[r]
    assert "1" not in os.listdir(directory)  # never listed


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
