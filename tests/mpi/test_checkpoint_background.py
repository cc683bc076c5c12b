"""Background saves on real ranks (2 and 4): save returns with a host copy, the write goes on,
the next call waits for it, and its error reaches every rank."""

import os
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import jaxddp
from tests.mpi.unwritable import make_unwritable

MPI_SIZES = (2, 4)

rank = jaxddp.rank()
size = jaxddp.world_size()
WORLD = MPI.COMM_WORLD
MB = 1 << 20


@pytest.fixture
def directory():
    """A fresh directory, the same path on every rank."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="jaxddp-bg-") if rank == 0 else None)
    yield os.path.join(path, "checkpoints")
    WORLD.Barrier()


def _big(value, mb=32):
    return jnp.full((mb * MB // 4,), value, jnp.float32)


def test_save_returns_before_the_write_ends_and_the_next_call_waits_for_it(directory):
    with jaxddp.CheckpointManager(directory) as ckpt:
        # the writer returned holding a copy; its write is still going (tens of MB through
        # Orbax take far longer than returning from save). A loaded machine that stalls
        # rank 0 past a write's end gets another save, three at most: a save that returns
        # after its write never passes.
        for step in (1, 2, 3):
            ckpt.save(step, {"w": _big(float(step))})
            writing, listed = WORLD.bcast(
                (
                    ckpt._write is not None and not ckpt._write.done(),
                    os.path.isdir(os.path.join(directory, str(step))),
                )
                if rank == 0
                else None
            )
            if writing:
                break
        assert writing
        assert not listed
        assert ckpt.all_steps()[-1] == step  # waited for it, on every rank
        assert ckpt._in_flight is None


def test_a_blocking_manager_returns_with_the_checkpoint_on_disk(directory):
    with jaxddp.CheckpointManager(directory, background=False) as ckpt:
        ckpt.save(1, {"w": _big(1.0, mb=4)})
        listed = WORLD.bcast(os.path.isdir(os.path.join(directory, "1")) if rank == 0 else None)
        assert listed
        assert ckpt._in_flight is None


def test_what_is_written_is_what_was_passed_whatever_the_loop_does_after(directory):
    params = {"w": _big(1.0, mb=8)}
    host = np.full(1000, 5.0, np.float32)
    step = jax.jit(lambda p: jax.tree.map(lambda x: x * 0 + 7.0, p), donate_argnums=0)
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, {"params": params, "host": host})
        params = step(params)  # the saved buffer donated and overwritten
        # a NumPy leaf changed in place, to another value on each rank: the ranks' states
        # are compared behind `save`, and what they compare is what was passed
        host[:] = -1.0 - rank
        jax.block_until_ready(params)
        target = {"params": {"w": jnp.zeros_like(params["w"])}, "host": np.zeros_like(host)}
        restored = ckpt.restore(1, target)
    np.testing.assert_array_equal(restored["params"]["w"], np.ones(8 * MB // 4, np.float32))
    np.testing.assert_array_equal(restored["host"], np.full(1000, 5.0, np.float32))


def test_a_settled_write_leaves_no_thread_behind():
    """The thread counting a write's progress ends with the write, and waiting joins it: it
    used to be joined by nobody, and a test that looked right after the manager's wait
    found it alive by chance. Its first look (thousands of files in a temporary folder)
    outlasts the write here, so it is alive when the write ends, every time. (Each rank its
    own folder: pytest's `tmp_path` is not safe for ranks sharing one machine.)"""
    from jaxddp._training.checkpoint import background

    with tempfile.TemporaryDirectory() as folder:
        junk = os.path.join(folder, "0.orbax-checkpoint-tmp-0")  # walked by every look
        os.mkdir(junk)
        for i in range(3000):
            open(os.path.join(junk, str(i)), "w").close()
        write = background.Write(7, lambda: None, folder, lambda e: "other")
        assert write.wait() is None
        assert [t.name for t in threading.enumerate() if "checkpoint 7" in t.name] == []


@pytest.mark.parametrize("next_call", ["save", "latest_step", "restore", "close"])
def test_a_failed_background_write_is_raised_by_the_next_call_on_every_rank(directory, next_call):
    ckpt = jaxddp.CheckpointManager(directory)
    ckpt.save(1, {"w": jnp.zeros(3)})
    ckpt.wait_until_finished()
    locked = not make_unwritable(directory, True)
    try:
        if locked:
            ckpt.save(2, {"w": jnp.ones(3)})  # returns; the write fails behind it
            calls = {
                "save": lambda: ckpt.save(3, {"w": jnp.ones(3)}),
                "latest_step": ckpt.latest_step,
                "restore": lambda: ckpt.restore(None, {"w": jnp.zeros(3)}),
                "close": ckpt.close,
            }
            with pytest.raises(RuntimeError, match=r"save checkpoint 2.*(ermission|permitted)"):
                calls[next_call]()
    finally:
        assert make_unwritable(directory, False)
    if not locked:
        ckpt.close()
        pytest.skip("cannot make a directory unwritable here")  # decided on rank 0 for all
    if next_call == "close":
        assert ckpt._manager is None  # released all the same
        ckpt = jaxddp.CheckpointManager(directory)
    # the error was raised once; the older checkpoint is intact, and the loop goes on
    assert ckpt.all_steps() == [1]
    np.testing.assert_array_equal(ckpt.restore(None, {"w": jnp.ones(3)})["w"], np.zeros(3))
    ckpt.save(4, {"w": jnp.full(3, 4.0)})
    ckpt.close()
    assert (
        WORLD.allgather([t.name for t in threading.enumerate() if "checkpoint" in t.name])
        == [[]] * size
    )
