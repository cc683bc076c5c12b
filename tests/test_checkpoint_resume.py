"""Checkpoints across real kills: a job killed with SIGKILL resumes exactly, on
the same and on another number of ranks, and a kill during a save loses nothing saved."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.harness import launch

pytestmark = pytest.mark.slow  # real training jobs, killed and resumed

SCRIPT = str(Path(__file__).with_name("scripts") / "checkpointed_training.py")
STEPS = 39  # 3 epochs of ceil(203 / 16) steps


def _run(tmp_path, name, np_, *extra, directory="ckpt"):
    out = tmp_path / f"{name}.npz"
    result = launch(
        [SCRIPT, str(tmp_path / directory), str(out), *extra], np_, timeout=150, quick=True
    )
    return result, out


def _params(path):
    with np.load(path) as data:
        assert int(data["steps"]) == STEPS
        return {k: data[k] for k in data.files if k != "steps"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    result, out = _run(tmp, "full", 2)
    assert result.ok, result.report()
    return _params(out)


@pytest.fixture(scope="module")
def killed_after_second_save(tmp_path_factory):
    """first -> the checkpoint folder of a job on ``first`` ranks killed after its second save;
    each is run (and checked) once, and shared by the cases that start on that many ranks."""
    folders: dict[int, Path] = {}

    def get(first: int) -> Path:
        if first not in folders:
            tmp = tmp_path_factory.mktemp(f"killed-on-{first}")
            killed, out = _run(tmp, "killed", first, "--kill-after-save", "2")
            assert not killed.timed_out, killed.report()
            assert killed.returncode != 0
            assert "killing rank 0 after save 10" in killed.rank_logs["0"]
            assert not out.exists()
            assert sorted(os.listdir(tmp / "ckpt")) == ["10", "5"]
            folders[first] = tmp / "ckpt"
        return folders[first]

    return get


def _assert_close(got, expected):
    assert got.keys() == expected.keys()
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.parametrize(("first", "then"), [(2, 2), (2, 4), (4, 2)], ids=["2-2", "2-4", "4-2"])
def test_killed_after_its_second_save_and_resumed_ends_as_the_uninterrupted_run(
    tmp_path, uninterrupted, killed_after_second_save, first, then
):
    shutil.copytree(killed_after_second_save(first), tmp_path / "ckpt")
    resumed, out = _run(tmp_path, "resumed", then, "--resume")
    assert resumed.ok, resumed.report()
    assert f"resumed from step 10 on {then} ranks" in resumed.rank_logs["0"]
    _assert_close(_params(out), uninterrupted)


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_restorable(tmp_path, uninterrupted):
    killed, _ = _run(tmp_path, "killed", 2, "--kill-during-save", "10", "--ballast-mb", "200")
    assert not killed.timed_out, killed.report()
    assert killed.returncode != 0
    assert "killing rank 0 with SIGKILL during save 10" in killed.rank_logs["0"]
    names = os.listdir(tmp_path / "ckpt")
    assert "5" in names
    assert "10" not in names  # only Orbax's unfinished temporary folder, if anything
    resumed, out = _run(tmp_path, "resumed", 2, "--resume", "--ballast-mb", "200")
    assert resumed.ok, resumed.report()
    assert "resumed from step 5 on 2 ranks" in resumed.rank_logs["0"]
    _assert_close(_params(out), uninterrupted)


def test_a_signal_to_another_rank_during_a_background_save_keeps_what_was_saved(
    tmp_path, uninterrupted
):
    # rank 1 ends (SIGTERM) while rank 0 writes step 10 in the background: the launcher
    # ends rank 0 mid-write; step 5 stays the newest complete checkpoint, and restorable
    killed, _ = _run(tmp_path, "killed", 2, "--kill-during-save", "10", "--ballast-mb", "200",
                     "--kill-rank", "1", "--signal", "TERM")  # fmt: skip
    assert not killed.timed_out, killed.report()
    assert killed.returncode != 0
    assert "killing rank 1 with SIGTERM during save 10" in killed.rank_logs["1"]
    assert "10" not in os.listdir(tmp_path / "ckpt")
    resumed, out = _run(tmp_path, "resumed", 2, "--resume", "--ballast-mb", "200")
    assert resumed.ok, resumed.report()
    assert "resumed from step 5 on 2 ranks" in resumed.rank_logs["0"]
    _assert_close(_params(out), uninterrupted)


def test_resumed_past_a_damaged_checkpoint_it_saves_that_step_anew_and_ends_as_uninterrupted(
    tmp_path, uninterrupted, killed_after_second_save
):
    # Before the fix, the resumed run fell back to the older checkpoint, then died at its
    # next save of the damaged step with Orbax's StepAlreadyExistsError.
    shutil.copytree(killed_after_second_save(2), tmp_path / "ckpt")
    data = max((p for p in (tmp_path / "ckpt" / "10").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)  # fmt: skip
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated
    resumed, out = _run(tmp_path, "resumed", 2, "--resume")
    assert resumed.ok, resumed.report()
    assert "Checkpoint 10 is damaged" in resumed.rank_logs["0"]
    assert "resumed from step 5 on 2 ranks" in resumed.rank_logs["0"]
    assert "moved aside to" in resumed.rank_logs["0"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["10.damaged", "25", "30", "35"]
    _assert_close(_params(out), uninterrupted)
