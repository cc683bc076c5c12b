"""Which GPU each rank computes on (jaxddp/_runtime/gpus.py), chosen at ``import jaxddp`` from
the GPUs each rank sees, here those of the stand-in CUDA driver (tests/native/driver.c)."""

import json
import os
from pathlib import Path

import pytest

from tests.harness import launch, stand_in_driver

SCRIPT = Path(__file__).with_name("scripts") / "gpu_assign.py"
A, B = "0000:01:00.0", "0000:41:00.0"


def _assigned(np, *seen, **env):
    env = {**os.environ, "JAXDDP_TEST_CUDA_DRIVER": str(stand_in_driver()), **env}
    result = launch([str(SCRIPT), *seen], np, timeout=120, env=env, quick=True)
    assert result.ok, result.report()
    rows = [json.loads(log.strip().splitlines()[-1]) for log in result.rank_logs.values()]
    return sorted(rows, key=lambda row: row["rank"])


@pytest.mark.slow  # a launch
def test_ranks_take_a_nodes_gpus_in_turn_and_sharing_ranks_do_not_preallocate():
    # 3 ranks, each seeing both GPUs: ranks 0 and 2 share GPU 0, rank 1 has GPU 1 alone;
    # rank 2 chose its own memory fraction, which stands
    rows = _assigned(3, f"{A},{B}", f"{A},{B}", f"{A},{B}|XLA_PYTHON_CLIENT_MEM_FRACTION=0.3")
    assert [row["ordinal"] for row in rows] == [0, 1, 0]
    assert [row["visible"] for row in rows] == ["0", "1", "0"]
    assert [row["sharing"] for row in rows] == [[0, 2], [1], [0, 2]]
    assert [row["preallocate"] for row in rows] == ["false", None, None]
    assert "shared with rank 2;" in rows[0]["describe"], rows[0]["describe"]
    assert "jax_cuda_visible_devices=1" in rows[1]["describe"], rows[1]["describe"]


@pytest.mark.slow  # a launch
def test_a_rank_that_sees_one_gpu_keeps_it_and_ranks_on_one_gpu_share_it():
    # each rank sees one GPU (as with Slurm's --gpus-per-task=1): it keeps it, nothing to
    # pick; ranks 0 and 2 see A, 1 and 3 see B: two ranks on each, which do not preallocate
    rows = _assigned(4, A, B)
    assert [row["ordinal"] for row in rows] == [0, 0, 0, 0]
    assert [row["visible"] for row in rows] == ["all"] * 4  # one GPU seen: nothing to pick
    assert [row["sharing"] for row in rows] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert rows[1]["changes"] == ["XLA_PYTHON_CLIENT_PREALLOCATE=false"]


@pytest.mark.slow  # a launch
def test_off_leaves_the_devices_to_jax():
    rows = _assigned(2, f"{A},{B}", JAXDDP_GPUS="off")
    assert [row["ordinal"] for row in rows] == [None, None]
    assert [row["visible"] for row in rows] == ["all", "all"]
    assert [row["preallocate"] for row in rows] == [None, None]
    assert "JAXDDP_GPUS=off" in rows[0]["describe"]
