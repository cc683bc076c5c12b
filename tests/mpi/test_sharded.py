"""jaxddp.shard_optimizer on real ranks (2, 3 and 4): ZeRO stage 1, exact, checkpointed.

The reference is ``optax.chain(jaxddp.allreduce_gradients(), inner)`` on the same ranks, or
on ``MPI.COMM_SELF`` (one process) for a run that changes world size: every rank of a
communicator of ``n`` ranks takes its ``12 / n`` rows of the same global batch, so the mean
of their gradients is the one-process gradient. 49 parameters: no world size divides them.
"""

import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from mpi4py import MPI

import jaxddp

MPI_SIZES = (2, 3, 4)
# Once more at 2 ranks as on a GPU: the ordered path, and every jitted collective through
# the handlers of GPU programs, their host side run on the CPU against the stand-in CUDA
# driver (tests/native/driver.c).
MPI_VARIANTS = {
    "staged": {
        "JAXDDP_TEST_STAGED": "1",
        "JAXDDP_TEST_CUDA_DRIVER": "<stand-in CUDA driver>",
        "JAXDDP_TEST_COLLECTIVE_PATH": "ordered",
    }
}
MPI_VARIANT_SIZES = {"staged": (2,)}

rank = jaxddp.rank()
size = jaxddp.world_size()
WORLD = MPI.COMM_WORLD
SELF = MPI.COMM_SELF
# the first two ranks: where the checkpoint that every world size resumes is written
PAIR = WORLD.Split(color=0 if rank < 2 else MPI.UNDEFINED, key=rank)
BATCH = 12


class Net(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


GRAPHDEF = nnx.graphdef(Net(nnx.Rngs(0)))


def _batch(step, comm=WORLD):
    """This rank's rows of global batch ``step``, for a communicator of ``comm``'s size."""
    rng = np.random.default_rng(step)
    x = rng.standard_normal((BATCH, 4), dtype=np.float32)
    y = rng.standard_normal((BATCH, 1), dtype=np.float32)
    n, i = comm.Get_size(), comm.Get_rank()
    rows = slice(i * BATCH // n, (i + 1) * BATCH // n)
    return jnp.asarray(x[rows]), jnp.asarray(y[rows])


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _assert_close(a, b, tol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@nnx.jit
def _nnx_step(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(_loss)(model, x, y))


_nnx_grad = nnx.jit(nnx.grad(_loss))


def _train_nnx(tx, epochs, steps, jit):
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for step in range(epochs * steps):
        x, y = _batch(step)
        if jit:
            _nnx_step(model, optimizer, x, y)
        else:  # the gradient compiled, the update (and its collectives) eager
            optimizer.update(model, _nnx_grad(model, x, y))
    return nnx.state(model, nnx.Param), optimizer


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_nnx_training_equals_allreduce_gradients_then_adam(jit):
    # 3 epochs (of 3 steps jitted, 1 eager) with nnx.Optimizer, unchanged
    steps = 3 if jit else 1
    ours, optimizer = _train_nnx(jaxddp.shard_optimizer(optax.adam(1e-3)), 3, steps, jit)
    ref, _ = _train_nnx(optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3)), 3, steps, jit)
    _assert_close(ours, ref)
    start = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a - b)).max()), ours, start)
    assert max(jax.tree.leaves(moved)) > 1e-4  # it trained
    assert isinstance(optimizer.opt_state, jaxddp.ShardedState)


@pytest.mark.parametrize(
    "inner",
    [optax.adamw(1e-2, weight_decay=0.1), optax.lion(1e-3),
     optax.sgd(optax.cosine_decay_schedule(0.1, 5), momentum=0.9)],
    ids=["adamw", "lion", "momentum-schedule"],  # adam: the NNX test; more: tests/test_sharded.py
)  # fmt: skip
def test_elementwise_optimizers_equal_the_unsharded_chain(inner):
    params = nnx.state(Net(nnx.Rngs(1)), nnx.Param)
    grad = jax.jit(jax.grad(lambda p, x, y: _loss(nnx.merge(GRAPHDEF, p), x, y)))
    tx, ref = jaxddp.shard_optimizer(inner), optax.chain(jaxddp.allreduce_gradients(), inner)
    state, ref_state, ours, theirs = tx.init(params), ref.init(params), params, params
    for step in range(3):
        x, y = _batch(step)
        updates, state = jax.jit(tx.update)(grad(ours, x, y), state, ours)
        ours = optax.apply_updates(ours, updates)
        updates, ref_state = jax.jit(ref.update)(grad(theirs, x, y), ref_state, theirs)
        theirs = optax.apply_updates(theirs, updates)
    _assert_close(ours, theirs)
    _assert_close(tx.gather_state(state, ours), ref_state[1])  # the full state, too


def _nbytes(tree):
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def test_the_state_held_per_rank_is_one_wth_of_the_unsharded_one_plus_padding():
    params = {"w": jnp.ones((101, 7)), "b": jnp.ones(13), "h": jnp.ones(30, jnp.bfloat16)}
    ours = jaxddp.shard_optimizer(optax.adam(1e-3)).init(params)
    full = optax.adam(1e-3).init(params)
    count = np.asarray(full[0].count).nbytes
    # two copies (mu, nu) of each dtype's padding: at most size - 1 elements each
    padding = 2 * (size - 1) * (4 + 2)
    assert _nbytes(ours) - count <= (_nbytes(full) - count) / size + padding
    assert _nbytes(ours) < _nbytes(full) / (size - 0.5)
    # every rank's slice together is the whole state, once
    total = WORLD.allreduce(_nbytes(ours) - count)
    assert _nbytes(full) - count <= total <= _nbytes(full) - count + padding


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_unused_parameters_on_some_ranks_are_zeros(jit):
    # and a dtype of empty leaves only: nothing of it travels
    params = {
        "used": jnp.arange(5.0),
        "branch": {"w": jnp.ones((2, 3))},
        "e": jnp.ones((0, 2), jnp.float16),
    }
    grads = {"used": jnp.arange(5.0) * (rank + 1), "e": jnp.ones((0, 2), jnp.float16)}
    if rank != 0:  # rank 0 did not run the branch
        grads["branch"] = {"w": jnp.full((2, 3), 2.0)}
    else:
        grads["branch"] = None
    tx = jaxddp.shard_optimizer(optax.sgd(1.0))
    update = jax.jit(tx.update) if jit else tx.update
    updates, _ = update(grads, tx.init(params), params)
    mean = np.arange(5.0) * (size + 1) / 2
    np.testing.assert_allclose(updates["used"], -mean, rtol=1e-6)
    np.testing.assert_allclose(updates["branch"]["w"], -2.0 * (size - 1) / size, rtol=1e-6)
    assert updates["e"].shape == (0, 2)
    with pytest.raises(ValueError, match="`params` was not passed"):  # on every rank
        update({**grads, "branch": None}, tx.init(params))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_clip_global_norm_is_exact(jit):
    params = {"w": jnp.arange(6.0), "h": jnp.ones((5, 3))}
    grads = {"w": jnp.arange(6.0) * (rank + 1), "h": jnp.full((5, 3), rank + 1.0)}
    tx = jaxddp.shard_optimizer(optax.sgd(0.1), clip_global_norm=1.5)
    ref = optax.chain(jaxddp.allreduce_gradients(), optax.clip_by_global_norm(1.5), optax.sgd(0.1))
    f = jax.jit if jit else (lambda g: g)
    ours, _ = f(tx.update)(grads, tx.init(params), params)
    theirs, _ = f(ref.update)(grads, ref.init(params), params)
    _assert_close(ours, theirs)
    plain = optax.chain(jaxddp.allreduce_gradients(), optax.sgd(0.1))
    unclipped, _ = f(plain.update)(grads, plain.init(params), params)
    assert not np.allclose(ours["w"], unclipped["w"])  # the norm (> 1.5) was clipped


def test_allreduce_gradients_inside_the_inner_optimizer_is_refused_on_every_rank():
    """It would average this rank's slice with the other ranks' slices (other parameters)."""
    inner = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"communicates across the ranks.*jaxddp_"):
        jaxddp.shard_optimizer(inner).init({"w": jnp.ones((8, 8)), "b": jnp.ones(8)})


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_gradient_trees_that_differ_across_ranks_raise_on_every_rank(jit):
    params = {"w": jnp.ones(3 if rank == 0 else 4)}  # rank 0's model is another
    tx = jaxddp.shard_optimizer(optax.sgd(1.0))
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(jaxddp.TreeMismatchError, match=r"`\['w'\]`: rank 0 has float32\[3\]"):
        update(params, tx.init(params), params)


# ---- checkpoints: written at 2 ranks, resumed at every world size ---------------------------

EPOCHS, STEPS = 3, 2


def _functional(comm, tx):
    graphdef = nnx.graphdef(Net(nnx.Rngs(0)))

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: _loss(nnx.merge(graphdef, p), x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run(params, opt_state, steps):
        for s in steps:
            params, opt_state = step(params, opt_state, *_batch(s, comm))
        return params, opt_state

    return run


@pytest.fixture
def directory():
    path = WORLD.bcast(tempfile.mkdtemp(prefix="jaxddp-sharded-") if rank == 0 else None)
    yield os.path.join(path, "checkpoints")
    WORLD.Barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_a_checkpoint_written_on_two_ranks_resumes_on_any_world_size(directory):
    params = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    total, first = range(EPOCHS * STEPS), range(STEPS)
    ref_tx = optax.chain(jaxddp.allreduce_gradients(comm=SELF), optax.adam(1e-3))
    expected, _ = _functional(SELF, ref_tx)(params, ref_tx.init(params), total)
    if PAIR != MPI.COMM_NULL:  # epoch 1 on two ranks, then a checkpoint
        tx = jaxddp.shard_optimizer(optax.adam(1e-3), comm=PAIR)
        done, state = _functional(PAIR, tx)(params, tx.init(params), first)
        with jaxddp.CheckpointManager(directory, comm=PAIR) as ckpt:
            ckpt.save(STEPS, {"params": done, "opt": tx.gather_state(state, done)})
    WORLD.Barrier()
    target = {"params": params, "opt": optax.adam(1e-3).init(params)}
    rest = range(STEPS, EPOCHS * STEPS)
    # every rank of the world, sharded over the world
    with jaxddp.CheckpointManager(directory) as ckpt:
        restored = ckpt.restore(ckpt.latest_step(), target)
    tx = jaxddp.shard_optimizer(optax.adam(1e-3))
    state = tx.shard_state(restored["opt"], restored["params"])
    ours, _ = _functional(WORLD, tx)(restored["params"], state, rest)
    _assert_close(ours, expected)
    # one process (each rank on its own): the sharded optimizer on a world of one, and the
    # unsharded chain
    with jaxddp.CheckpointManager(directory, comm=SELF) as ckpt:
        restored = ckpt.restore(STEPS, target)
    one = jaxddp.shard_optimizer(optax.adam(1e-3), comm=SELF)
    state = one.shard_state(restored["opt"], restored["params"])
    alone, _ = _functional(SELF, one)(restored["params"], state, rest)
    _assert_close(alone, expected)
    unsharded = (optax.EmptyState(), restored["opt"])
    plain, _ = _functional(SELF, ref_tx)(restored["params"], unsharded, rest)
    _assert_close(plain, expected)


def test_a_sharded_state_saved_as_nnx_state_of_the_optimizer_is_refused_on_every_rank(directory):
    # nnx.state(optimizer) turns the ShardedState into a mapping of arrays, each rank's own
    # slices: it used to be saved as rank 0's alone, and restored, every rank held those.
    model, optimizer = _train_nnx(jaxddp.shard_optimizer(optax.adam(1e-3)), 1, 3, True)
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, {"model": model, "opt": nnx.state(optimizer)})  # compared behind it
        with pytest.raises(ValueError, match=r"^Could not save checkpoint 1 in") as info:
            ckpt.wait_until_finished()
        text = str(info.value)
        assert "differs between ranks at `['opt']['opt_state']['inner']" in text, text
        assert WORLD.allgather(text) == [text] * size  # the same error on every rank
        assert "save `optimizer.opt_state`" in text
        assert ckpt.all_steps() == []
        ckpt.save(1, {"model": model, "opt": optimizer.opt_state})  # as the docs say
        assert ckpt.all_steps() == [1]
