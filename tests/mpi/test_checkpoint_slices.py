"""A ShardedState checkpointed as it is, on real ranks (2, 3 and 4): every rank writes its
own slices; a restore at another world size cuts them anew (2 -> 3, 2 -> 4, 4 -> 2, 3 -> 2,
W -> 1) and trains on to the uninterrupted run's parameters; a damaged slice is an error on
every rank; a rank's save holds its slice, not the whole state.

The reference is ``optax.chain(jaxddp.allreduce_gradients(), adam)`` on ``MPI.COMM_SELF``
(one process): every rank of a communicator of ``n`` ranks takes its ``12 / n`` rows of the
same global batch. The bfloat16 leaf's gradient is the leaf itself on every rank (its loss
term does not depend on the data), so its mean is exact at every world size.
"""

import os
import shutil
import tempfile
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import jaxddp

MPI_SIZES = (2, 3, 4)

rank = jaxddp.rank()
size = jaxddp.world_size()
WORLD = MPI.COMM_WORLD
SELF = MPI.COMM_SELF
PAIR = WORLD.Split(color=0 if rank < 2 else MPI.UNDEFINED, key=rank)  # the first two ranks
BATCH, FIRST, TOTAL = 12, 2, 5
PARAMS = {  # odd sizes: no world size divides them; float32 and bfloat16 groups
    "w": jnp.linspace(-0.5, 0.5, 4 * 7, dtype=jnp.float32).reshape(4, 7),
    "b": jnp.zeros(7, jnp.float32),
    "v": jnp.linspace(-1, 1, 7, dtype=jnp.float32),
    "h": jnp.linspace(-2, 2, 13, dtype=jnp.bfloat16),
}


def _loss(p, x, y):
    pred = jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
    return jnp.mean((pred - y) ** 2) + 0.5 * jnp.sum(p["h"].astype(jnp.float32) ** 2)


def _batch(step, comm):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((BATCH, 4), dtype=np.float32)
    y = rng.standard_normal((BATCH,), dtype=np.float32)
    n, i = comm.Get_size(), comm.Get_rank()
    rows = slice(i * BATCH // n, (i + 1) * BATCH // n)
    return jnp.asarray(x[rows]), jnp.asarray(y[rows])


_STEPS = {}  # (communicator's handle, sharded?) -> (tx, its jitted step): compiled once


def _tools(comm, sharded=True):
    key = (comm.py2f(), sharded)
    if key not in _STEPS:
        tx = (
            jaxddp.shard_optimizer(optax.adam(1e-2), comm=comm)
            if sharded
            else optax.chain(jaxddp.allreduce_gradients(comm=comm), optax.adam(1e-2))
        )

        @jax.jit
        def step(params, state, x, y):
            updates, state = tx.update(jax.grad(_loss)(params, x, y), state, params)
            return optax.apply_updates(params, updates), state

        _STEPS[key] = tx, step
    return _STEPS[key]


def _train(comm, params, state, steps, sharded=True):
    step = _tools(comm, sharded)[1]
    for s in steps:
        params, state = step(params, state, *_batch(s, comm))
    return params, state


def _assert_close(a, b, tol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), tol, tol)


@pytest.fixture
def directory():
    path = WORLD.bcast(tempfile.mkdtemp(prefix="jaxddp-slices-") if rank == 0 else None)
    yield path
    WORLD.Barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _resume(comm, directory):
    """Restores the newest checkpoint into ``tx.init(params)`` on ``comm`` and trains on."""
    tx = _tools(comm)[0]
    with jaxddp.CheckpointManager(directory, comm=comm) as ckpt:
        restored = ckpt.restore(None, {"params": PARAMS, "opt": tx.init(PARAMS)})
    assert restored["opt"].slicing.size == comm.Get_size()
    assert int(restored["opt"].inner[0].count) == FIRST
    return _train(comm, restored["params"], restored["opt"], range(FIRST, TOTAL))[0]


def test_a_sharded_state_saved_at_one_world_size_trains_on_at_any_other(directory):
    ref = _tools(SELF, sharded=False)[0]
    expected, _ = _train(SELF, PARAMS, ref.init(PARAMS), range(TOTAL), sharded=False)
    pair, world = os.path.join(directory, "pair"), os.path.join(directory, "world")

    def save(comm, where):
        params, state = _train(comm, PARAMS, _tools(comm)[0].init(PARAMS), range(FIRST))
        with jaxddp.CheckpointManager(where, comm=comm) as ckpt:
            ckpt.save(FIRST, {"params": params, "opt": state})

    if PAIR != MPI.COMM_NULL:
        save(PAIR, pair)
    save(WORLD, world)
    WORLD.Barrier()
    files = sorted(os.listdir(os.path.join(world, f"{FIRST}.slices")))
    assert files == [f"rank-{r:05d}-of-{size:05d}.bin" for r in range(size)]
    _assert_close(_resume(WORLD, pair), expected)  # 2 -> W
    if PAIR != MPI.COMM_NULL:
        _assert_close(_resume(PAIR, world), expected)  # W -> 2
    _assert_close(_resume(SELF, world), expected)  # W -> 1, each rank on its own


def test_a_damaged_slice_is_an_error_on_every_rank_naming_step_file_and_entry(directory):
    tx = jaxddp.shard_optimizer(optax.adam(1e-2))
    state = tx.init(PARAMS)
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, {"opt": state})
        ckpt.save(2, {"opt": state})
        if rank == 0:  # a byte of the last rank's file of step 2
            path = os.path.join(directory, "2.slices", f"rank-{size - 1:05d}-of-{size:05d}.bin")
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x40]))
        WORLD.Barrier()
        name = rf"rank-{size - 1:05d}-of-{size:05d}\.bin"
        pattern = rf"Checkpoint 2 is damaged: the slice `opt/inner/0/\w+/\d` in {name}"
        with pytest.raises(jaxddp.DamagedCheckpointError, match=pattern):
            ckpt.restore(2, {"opt": tx.init(PARAMS)})
        with pytest.warns(RuntimeWarning, match=r"Falling back to checkpoint 1"):
            restored = ckpt.restore(None, {"opt": tx.init(PARAMS)})
    _assert_close(restored["opt"], state)


def test_a_ranks_save_holds_its_slice_not_the_whole_state(directory):
    params = {"w": jnp.ones(2_000_003, jnp.float32), "h": jnp.ones(100_001, jnp.bfloat16)}
    tx = jaxddp.shard_optimizer(optax.adam(1e-2))
    state = tx.init(params)
    mine = sum(
        x.nbytes for x in jax.tree.leaves(state.inner[0].mu) + jax.tree.leaves(state.inner[0].nu)
    )
    whole = 2 * (2_000_003 * 4 + 100_001 * 2)  # adam's mu and nu, unsharded
    small = 2 << 20
    assert mine + small < whole
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(0, {"opt": state})  # Orbax's first save: its imports and caches
        tracemalloc.start()
        ckpt.save(1, {"opt": state})
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    peaks = WORLD.allgather(peak)
    assert max(peaks) < mine + small, (peaks, mine, whole)


@pytest.mark.parametrize("leftover", [False, True], ids=["no-folder", "a-folder-of-its-own"])
def test_a_directory_the_ranks_do_not_share_is_an_error_on_every_rank(directory, leftover):
    # each rank its own directory, as on nodes without a shared file system; with a leftover
    # folder of the step on the other ranks, they write their files where the first rank
    # does not see them
    own = os.path.join(directory, f"rank-{rank}")
    if leftover and rank != 0:
        os.makedirs(os.path.join(own, "1.slices.tmp"))
    tx = jaxddp.shard_optimizer(optax.adam(1e-2))
    target = {"opt": tx.init(PARAMS)}
    with jaxddp.CheckpointManager(own) as ckpt:
        with pytest.raises(RuntimeError, match=r"does not see .*every rank can write and read"):
            ckpt.save(1, {"opt": tx.init(PARAMS)})
        assert ckpt.all_steps() == []
    # a checkpoint in a shared directory, read where only the first rank sees it
    shared = os.path.join(directory, "shared")
    with jaxddp.CheckpointManager(shared) as ckpt:
        ckpt.save(1, target)
    with jaxddp.CheckpointManager(shared if rank == 0 else own) as ckpt:
        with pytest.raises(RuntimeError, match=r"does not see the folder .*1\.slices") as info:
            ckpt.restore(1, target)
        assert not isinstance(info.value, jaxddp.DamagedCheckpointError)


def test_a_state_rebuilt_without_its_slicing_on_one_rank_is_refused_on_every_rank(directory):
    tx = jaxddp.shard_optimizer(optax.adam(1e-2))
    state = tx.init(PARAMS)
    if rank == 0:
        state = jaxddp.ShardedState(state.inner)
    with jaxddp.CheckpointManager(directory) as ckpt:
        with pytest.raises(ValueError, match=r"on rank 0\).*does not say how it is sliced"):
            ckpt.save(1, {"opt": state})
        assert ckpt.all_steps() == []
