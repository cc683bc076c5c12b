"""The examples of the docs page "Bring your own model and data" (docs/examples/): each
trains under a real ``mpiexec -n 2`` to the parameters one process reaches with the same
global batch, identical on both ranks. One launch runs them all, one process runs them all."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness import launch
from tests.scripts.docs_examples import NAMES

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "docs_examples.py"
for _module in ("equinox", "grain", "torch"):  # the test session installs them all
    pytest.importorskip(_module)


def _arrays(path):
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    result = launch([str(SCRIPT), str(two)], 2, timeout=600)
    assert result.ok, result.report()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(one)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return two, one, result.rank_logs["0"]


@pytest.mark.parametrize("name", NAMES)
def test_the_example_on_two_ranks_trains_the_one_process_model(runs, name):
    two, one, log = runs
    rank0, rank1 = _arrays(two / f"{name}-rank0.npz"), _arrays(two / f"{name}-rank1.npz")
    alone = _arrays(one / f"{name}-rank0.npz")
    assert f"{name}: done" in log
    assert "epoch 2: loss" in log
    assert len(rank0) == len(alone) > 0
    for a, b in zip(rank0, rank1, strict=True):
        np.testing.assert_array_equal(a, b)  # the same model on both ranks
    for a, b in zip(rank0, alone, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
