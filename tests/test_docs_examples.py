"""The examples of the docs page "Bring your own model and data" (docs/examples/): each
trains under a real ``mpiexec -n 2`` to the parameters one process reaches with the same
global batch, identical on both ranks. One launch runs them all, one process runs them all."""

import importlib.util
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
# what an example needs beyond the test extras: the test sessions install all but torch
# everywhere, torch where its CPU build is served (noxfile.py: TORCH_CPU)
NEEDS = {"equinox_model": "equinox", "grain_pipeline": "grain", "torch_dataloader": "torch"}
MISSING = {n for n, m in NEEDS.items() if importlib.util.find_spec(m) is None}
RUN = [n for n in NAMES if n not in MISSING]


def _arrays(path):
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    result = launch([str(SCRIPT), str(two), *RUN], 2, timeout=600)
    assert result.ok, result.report()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(one), *RUN],
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
    if name in MISSING:
        pytest.skip(f"{NEEDS[name]} is not installed")
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
