"""A damaged checkpoint is never restored silently, on real ranks.

One flipped bit in a data file of the newest checkpoint used to restore without a word and
end on another model; 64 bytes XORed gave a loss of nan. Every saved array now carries a
CRC-32 that the reading rank verifies before any rank uses the values.
"""

import json
import os
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import jaxddp

MPI_SIZES = (2,)

rank = jaxddp.rank()
WORLD = MPI.COMM_WORLD


@pytest.fixture
def directory():
    path = WORLD.bcast(tempfile.mkdtemp(prefix="jaxddp-damage-") if rank == 0 else None)
    yield os.path.join(path, "checkpoints")
    WORLD.Barrier()


def _state(step):
    return {"w": jnp.arange(50_000, dtype=jnp.float32) * step, "b": jnp.ones(3), "step": step}


def _damage(ckpt, directory, step, how):
    """On the writing rank: changes the largest file of checkpoint ``step``, once ``ckpt``'s
    save in flight is on disk."""
    ckpt.wait_until_finished()
    if rank == 0:
        files = [
            os.path.join(root, f)
            for root, _, names in os.walk(os.path.join(directory, str(step)))
            for f in names
        ]
        largest = max(files, key=os.path.getsize)
        with open(largest, "rb") as f:
            data = bytearray(f.read())
        middle = len(data) // 2
        if how == "bit":
            data[middle] ^= 0x01
        elif how == "xor64":
            data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
        else:  # truncated
            data = data[:middle]
        with open(largest, "wb") as f:
            f.write(bytes(data))
    WORLD.Barrier()


@pytest.mark.parametrize("how", ["bit", "xor64", "truncated"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one_on_every_rank(directory, how):
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
        _damage(ckpt, directory, 2, how)
        with pytest.warns(
            RuntimeWarning, match=r"Checkpoint 2 is damaged.*Falling back to checkpoint 1"
        ):
            restored = ckpt.restore(None, _state(0))
        assert restored["step"] == 1
        np.testing.assert_array_equal(restored["w"], _state(1)["w"])
        # an explicit restore of the damaged step is an error on every rank
        with pytest.raises(jaxddp.DamagedCheckpointError, match="Checkpoint 2 is damaged"):
            ckpt.restore(2, _state(0))


def test_when_no_checkpoint_is_intact_the_resume_is_an_error_on_every_rank(directory):
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
        _damage(ckpt, directory, 1, "bit")
        _damage(ckpt, directory, 2, "bit")
        with (
            pytest.warns(RuntimeWarning, match="Falling back to checkpoint 1"),
            pytest.raises(jaxddp.DamagedCheckpointError, match=r"Checkpoint 1 is damaged.*\['w'\]"),
        ):
            ckpt.restore(None, _state(0))
        # an intact one saved after them restores as ever
        ckpt.save(3, _state(3))
        assert ckpt.restore(None, _state(0))["step"] == 3


def _edit_metadata(ckpt, directory, step, how):
    """On the writing rank: changes the step's own metadata, where its checksums are, once
    ``ckpt``'s save in flight is on disk."""
    ckpt.wait_until_finished()
    if rank == 0:
        path = os.path.join(directory, str(step), "_CHECKPOINT_METADATA")
        with open(path) as f:
            text = f.read()
        if how == "cut in half":
            text = text[: len(text) // 2]
        else:
            metadata = json.loads(text)
            if how == "without jaxddp's entry":  # as an older jaxddp wrote it
                del metadata["custom_metadata"]["jaxddp"]
            else:  # "without the checksum of w"
                del metadata["custom_metadata"]["jaxddp"]["crc32"]["w"]
            text = json.dumps(metadata)
        with open(path, "w") as f:
            f.write(text)
    WORLD.Barrier()


@pytest.mark.parametrize(
    "how", ["cut in half", "without jaxddp's entry", "without the checksum of w"]
)
def test_a_step_without_its_checksums_is_damaged_and_never_restored_unverified(directory, how):
    # Before the fix, metadata cut in half and a flipped bit restored 2 wrong values of `w`
    # on every rank, silently; so did valid metadata without jaxddp's entry.
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
        _edit_metadata(ckpt, directory, 2, how)
        _damage(ckpt, directory, 2, "bit")
        with pytest.raises(jaxddp.DamagedCheckpointError, match="Checkpoint 2 is damaged"):
            ckpt.restore(2, _state(0))
        with pytest.warns(
            RuntimeWarning, match=r"Checkpoint 2 is damaged.*Falling back to checkpoint 1"
        ):
            restored = ckpt.restore(None, _state(0))
        assert restored["step"] == 1
        np.testing.assert_array_equal(restored["w"], _state(1)["w"])


def test_a_checkpoint_without_checksums_restores_only_when_asked_with_a_warning(directory):
    # what a jaxddp before checksums wrote: valid metadata without jaxddp's entry
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, _state(1))
        _edit_metadata(ckpt, directory, 1, "without jaxddp's entry")
        with pytest.raises(jaxddp.DamagedCheckpointError, match="allow_missing_checksums=True"):
            ckpt.restore(1, _state(0))
        with pytest.raises(jaxddp.DamagedCheckpointError, match="holds no checksums"):
            ckpt.restore(None, _state(0))  # the only one: no fallback
        with pytest.warns(RuntimeWarning, match="Checkpoint 1 .* restored unverified"):
            restored = ckpt.restore(1, _state(0), allow_missing_checksums=True)
        np.testing.assert_array_equal(restored["w"], _state(1)["w"])
        # checksums that are there are verified all the same
        ckpt.save(2, _state(2))
        _damage(ckpt, directory, 2, "bit")
        with pytest.raises(
            jaxddp.DamagedCheckpointError, match=r"Checkpoint 2 is damaged.*\['w'\]"
        ):
            ckpt.restore(2, _state(0), allow_missing_checksums=True)


def test_the_save_of_a_step_found_damaged_moves_it_aside_and_saves_anew(directory):
    # Before the fix, the resumed run's next save of the skipped step failed with Orbax's
    # StepAlreadyExistsError.
    with jaxddp.CheckpointManager(directory, max_to_keep=2) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
        _damage(ckpt, directory, 2, "truncated")
        with pytest.warns(RuntimeWarning, match="Falling back to checkpoint 1"):
            assert ckpt.restore(None, _state(0))["step"] == 1
        aside = os.path.join(directory, "2.damaged")
        with pytest.warns(RuntimeWarning, match=f"Checkpoint 2 .* moved aside to '{aside}'"):
            ckpt.save(2, _state(20))
        assert ckpt.all_steps() == [1, 2]
        restored = ckpt.restore(None, _state(0))  # no warning: it is intact
        assert restored["step"] == 20
        ckpt.save(3, _state(3))  # max_to_keep counts the steps alone
        assert ckpt.all_steps() == [2, 3]
        # a step that was not found damaged is still saved once
        with pytest.raises(RuntimeError, match="save checkpoint 3"):
            ckpt.save(3, _state(3))
    seen = WORLD.bcast(sorted(os.listdir(directory)) if rank == 0 else None)
    assert seen == ["2", "2.damaged", "3"]


def test_a_full_disk_during_a_save_is_a_runtime_error_on_every_rank():
    # a 64 KiB tmpfs as the disk (we are root in CI; decided on rank 0 for every rank)
    where = tempfile.mkdtemp(prefix="jaxddp-full-") if rank == 0 else None
    mounted = rank == 0 and os.system(f"mount -t tmpfs -o size=64k tmpfs {where}") == 0
    where, mounted = WORLD.bcast((where, mounted))
    if not mounted:
        pytest.skip("mounting a small tmpfs needs root")  # the same decision on every rank
    folder = os.path.join(where, "ckpt")
    try:
        with jaxddp.CheckpointManager(folder) as ckpt:
            ckpt.save(1, {"w": jnp.arange(1_000_000, dtype=jnp.float32)})
            with pytest.raises(RuntimeError, match=r"save checkpoint 1.*No space left") as info:
                ckpt.wait_until_finished()
            assert not isinstance(info.value, ValueError)  # tensorstore's own type
            # the failed write's temporary folder is gone (it stayed, one per failed step,
            # and filled the disk for good), and the next saves find the room
            assert WORLD.bcast(os.listdir(folder) if rank == 0 else None) == []
            ckpt.save(2, {"w": jnp.arange(1_000_000, dtype=jnp.float32)})
            with pytest.raises(RuntimeError, match=r"save checkpoint 2.*No space left"):
                ckpt.wait_until_finished()
            ckpt.save(3, {"w": jnp.arange(1_000, dtype=jnp.float32)})
            assert ckpt.all_steps() == [3]
            assert WORLD.bcast(sorted(os.listdir(folder)) if rank == 0 else None) == ["3"]
    finally:
        WORLD.Barrier()
        if rank == 0:
            os.system(f"umount {where}")
