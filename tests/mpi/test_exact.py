"""W ranks train exactly like one process, on real ranks (2 and 4).

The one-process reference runs on every rank itself, through the same code on
``MPI.COMM_SELF``: jaxddp with a world of one is plain JAX. A world of other size comes
from splitting ``COMM_WORLD``, so that one launch of 4 ranks can run 2 -> 4 and 4 -> 2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from mpi4py import MPI

import jaxddp

MPI_SIZES = (2, 4)
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
SELF = MPI.COMM_SELF


# ---- gradients through the collectives ------------------------------------------------------


def _squares(w, x, mask, comm=None):
    """The documented loss: masked_mean over the batch's per-sample losses."""
    return jaxddp.masked_mean((w * x - 1.0) ** 2, mask, comm=comm)


def _sync(grad, comm=None):
    tx = jaxddp.allreduce_gradients(comm=comm)
    return jax.jit(tx.update)({"w": grad}, tx.init(None))[0]["w"]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_gradient_through_masked_mean_then_allreduce_gradients_is_one_process_gradient(jit):
    # every rank holds 3 slots; rank r's real ones are its first r + 1 (at most 3)
    xs = np.arange(1.0, 3 * size + 1, dtype=np.float32).reshape(size, 3)
    masks = np.arange(3)[None, :] <= np.minimum(np.arange(size), 2)[:, None]
    grad = jax.grad(_squares)
    grad = jax.jit(grad) if jit else grad
    mine = grad(jnp.float32(0.5), jnp.asarray(xs[rank]), jnp.asarray(masks[rank]))
    real = xs[masks]
    one = jax.grad(lambda w: jnp.mean((w * jnp.asarray(real) - 1.0) ** 2))(jnp.float32(0.5))
    # each rank's own gradient is its share times the world size (psum's rule) ...
    share = np.sum(2 * (0.5 * xs[rank] - 1.0) * xs[rank] * masks[rank]) / masks.sum()
    np.testing.assert_allclose(mine, share * size, rtol=1e-6)
    # ... so that the mean over ranks is one process's gradient, not 1/W of it
    np.testing.assert_allclose(_sync(mine), one, rtol=1e-6)


def test_the_documented_loss_is_exact_when_ranks_hold_different_numbers_of_samples():
    # N = 3 on W ranks with batch 2: one process's loss is the mean of the 3 real samples;
    # a mean of per-rank means (the old recipe) weights rank 0's samples differently
    sampler = jaxddp.DistributedSampler(3, shuffle=False)
    values = np.array([10.0, 20.0, 200.0], np.float32)
    ((indices, mask),) = list(sampler.batches(2))
    w = jnp.float32(1.0)
    per_sample = lambda w: (w * jnp.asarray(values[indices])) ** 2
    loss, grad = jax.jit(
        jax.value_and_grad(lambda w: jaxddp.masked_mean(per_sample(w), jnp.asarray(mask)))
    )(w)
    one_loss, one_grad = jax.value_and_grad(lambda w: jnp.mean((w * jnp.asarray(values)) ** 2))(w)
    np.testing.assert_allclose(loss, one_loss, rtol=1e-6)
    np.testing.assert_allclose(_sync(grad), one_grad, rtol=1e-6)
    old = jnp.sum(per_sample(w) * mask) / jnp.maximum(jnp.sum(mask), 1)
    biased = jaxddp.allreduce(old, op="mean")
    assert not np.isclose(biased, one_loss)  # the recipe the docs no longer give


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_pass_the_gradient_to_the_extreme_rank_shared_among_ties(op):
    # entry 0: held by the last rank; entry 1: a tie of all ranks; entry 2: rank 0's
    sign = 1.0 if op == "max" else -1.0
    x = jnp.array([sign * rank, 1.0, -sign * rank])
    total = lambda v: jnp.sum(jaxddp.allreduce(v, op=op) * jnp.array([1.0, 2.0, 3.0]))
    grad = jax.jit(jax.grad(total))(x)
    weights = np.array([1.0, 2.0, 3.0])
    owns = np.array([rank == size - 1, True, rank == 0], np.float32)
    ties = np.array([1.0, size, 1.0])
    # psum's scaling: each rank's gradient is size times its share of the one loss
    expected = size * weights * owns / ties
    np.testing.assert_allclose(grad, expected, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(total)(x), expected, rtol=1e-6)
    _, tangent = jax.jvp(lambda v: jaxddp.allreduce(v, op=op), (x,), (jnp.ones(3) * (rank + 1),))
    # the extreme's tangent: the last rank's, the mean of all ranks', rank 0's
    np.testing.assert_allclose(tangent, [size, (size + 1) / 2, 1.0], rtol=1e-6)


@pytest.mark.parametrize("name", ["broadcast", "reduce"])
def test_differentiating_a_broadcast_or_reduce_is_a_clear_error(name):
    collective = {
        "broadcast": lambda v: jaxddp.broadcast(v, root=0),
        "reduce": lambda v: jaxddp.reduce(v, "sum", root=0),
    }[name]
    with pytest.raises(NotImplementedError, match="stop_gradient"):
        jax.jit(jax.grad(lambda v: jnp.sum(collective(v))))(jnp.ones(3))
    # its value alone, with the gradient stopped, is fine
    grad = jax.jit(jax.grad(lambda v: jnp.sum(collective(jax.lax.stop_gradient(v)) * v)))
    assert np.all(np.isfinite(grad(jnp.ones(3))))


# ---- a Flax NNX model, trained on W ranks and in one process --------------------------------

N, FEATURES, CLASSES, GLOBAL_BATCH, EPOCHS = 203, 5, 3, 16, 3


class Net(nnx.Module):
    def __init__(self, rngs):
        self.inner = nnx.Linear(FEATURES, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.norm(self.inner(x))))


_data = np.random.default_rng(7)
X = _data.normal(size=(N, FEATURES)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32) + (X[:, 1] > 0.5).astype(np.int32)
GRAPH, INITIAL = nnx.split(Net(nnx.Rngs(0)))  # the same on every rank


_trainers = {}


def _trainer(comm):
    """The optimizer and the jitted step for ``comm``, made once per communicator."""
    key = MPI._handleof(comm)
    if key not in _trainers:
        _trainers[key] = _make_trainer(comm)
    return _trainers[key]


def _make_trainer(comm):
    tx = optax.chain(jaxddp.allreduce_gradients(comm=comm), optax.adam(1e-2))

    @jax.jit
    def step(params, opt_state, x, y, mask):
        def loss_fn(p):
            logits = nnx.merge(GRAPH, p)(x)
            per_sample = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jaxddp.masked_mean(per_sample, mask, comm=comm)  # the documented loss

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, step


def _train(comm, *, resume=None, stop_after=None):
    """Trains for EPOCHS with the global batch GLOBAL_BATCH over ``comm``'s ranks.

    ``resume`` is a (params, opt_state, sampler state) saved by an earlier call, on any
    number of ranks; ``stop_after`` stops after that many steps and returns that triple.
    """
    tx, step = _trainer(comm)
    sampler = jaxddp.DistributedSampler(N, shuffle=True, seed=11, comm=comm)
    batch = GLOBAL_BATCH // comm.Get_size()
    if resume is None:
        params, opt_state, first = INITIAL, tx.init(INITIAL), 0
    else:
        params, opt_state, state = resume
        sampler.load_state_dict(state)
        first = sampler.epoch
    steps = 0
    for epoch in range(first, EPOCHS):
        if resume is None or epoch != first:  # the resumed epoch continues where it was
            sampler.set_epoch(epoch)
        for indices, mask in sampler.batches(batch):
            params, opt_state = step(params, opt_state, X[indices], Y[indices], mask)
            steps += 1
            if steps == stop_after:
                return params, opt_state, sampler.state_dict()
    return params, opt_state, sampler.state_dict()


@functools.cache
def _one_process():
    return _train(SELF)[0]


def _assert_same_params(got, expected):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def _identical_on_all_ranks(params, comm):
    flat = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(params)])
    everyone = comm.allgather(flat)
    return all(np.array_equal(flat, other) for other in everyone)


def test_w_ranks_with_batch_b_train_the_one_process_model_with_batch_w_times_b():
    params = _train(MPI.COMM_WORLD)[0]
    assert _identical_on_all_ranks(params, MPI.COMM_WORLD)
    _assert_same_params(params, _one_process())
    # the model did train: far from its initial parameters
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
        jax.tree.leaves(params), jax.tree.leaves(INITIAL), strict=True
    ))  # fmt: skip
    assert moved > 0.05


# Two communicators of size // 2, ranks [0, size/2) and [size/2, size) (one process each
# at 2 ranks): each half runs the same training, so both halves end alike.
HALF = MPI.COMM_WORLD.Split(color=int(rank >= size // 2), key=rank)


@pytest.mark.parametrize("stop_after", [5, 13 + 4])  # in the first epoch, in the second
def test_a_run_resumed_on_twice_as_many_ranks_ends_as_the_uninterrupted_run(stop_after):
    saved = _train(HALF, stop_after=stop_after)  # on W / 2 ranks (2 -> 4, or 1 -> 2) ...
    params = _train(MPI.COMM_WORLD, resume=saved)[0]  # ... resumed on W
    assert _identical_on_all_ranks(params, MPI.COMM_WORLD)
    _assert_same_params(params, _one_process())
    _assert_same_params(params, _train(MPI.COMM_WORLD)[0])


@pytest.mark.parametrize("stop_after", [5, 13 + 4])
def test_a_run_resumed_on_half_as_many_ranks_ends_as_the_uninterrupted_run(stop_after):
    saved = _train(MPI.COMM_WORLD, stop_after=stop_after)  # on W ranks ...
    params = _train(HALF, resume=saved)[0]  # ... resumed on W / 2 (4 -> 2, or 2 -> 1)
    assert _identical_on_all_ranks(params, MPI.COMM_WORLD)
    _assert_same_params(params, _one_process())
    _assert_same_params(params, _train(MPI.COMM_WORLD)[0])


# ---- batch norm over the global batch -------------------------------------------------------


class NormNet(nnx.Module):
    def __init__(self, comm, rngs):
        # no bias before the norm: its gradient is 0 up to rounding, which Adam would turn
        # into steps of +-lr in directions that differ between any two summation orders
        self.inner = nnx.Linear(FEATURES, 16, use_bias=False, rngs=rngs)
        self.norm = jaxddp.SyncBatchNorm(16, comm=comm, momentum=0.8, rngs=rngs)
        self.head = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x, mask):
        return self.head(jax.nn.relu(self.norm(self.inner(x), mask=mask[:, None])))


def _train_sync_batch_norm(comm):
    """One shuffled epoch of N = 203 with the global batch 16 over ``comm``'s ranks; the
    model's whole state (parameters and batch statistics) at the end."""
    model = NormNet(comm, nnx.Rngs(0))
    tx = optax.chain(jaxddp.allreduce_gradients(comm=comm), optax.adam(1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y, mask):
        def loss_fn(m):
            per_sample = optax.softmax_cross_entropy_with_integer_labels(m(x, mask), y)
            return jaxddp.masked_mean(per_sample, mask, comm=comm)

        optimizer.update(model, nnx.grad(loss_fn)(model))

    sampler = jaxddp.DistributedSampler(N, shuffle=True, seed=5, comm=comm)
    for indices, mask in sampler.batches(GLOBAL_BATCH // comm.Get_size()):
        step(model, optimizer, X[indices], Y[indices], mask)
    model.eval()
    return nnx.state(model), model(X[:8], np.ones(8, bool))


def test_sync_batch_norm_on_w_ranks_trains_as_one_process_batch_norm():
    state, out = _train_sync_batch_norm(MPI.COMM_WORLD)
    assert _identical_on_all_ranks(state, MPI.COMM_WORLD)  # no average_state needed
    one_state, one_out = _train_sync_batch_norm(SELF)
    _assert_same_params(state, one_state)  # parameters and running statistics
    np.testing.assert_allclose(out, one_out, rtol=1e-5, atol=1e-5)
    # and on one process it is Flax's own batch norm (the same statistics, masked)
    flax_norm = nnx.BatchNorm(16, momentum=0.8, rngs=nnx.Rngs(0))
    ours = jaxddp.SyncBatchNorm(16, comm=SELF, momentum=0.8, rngs=nnx.Rngs(0))
    x = jnp.asarray(X[:10, :1] * np.arange(16) + X[:10, 1:2])
    mask = jnp.arange(10) < 7
    np.testing.assert_allclose(
        ours(x, mask=mask[:, None]), flax_norm(x, mask=mask[:, None]), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(ours.var[...], flax_norm.var[...], rtol=1e-5)
    # the sampler's mask, one entry per sample, means the same, even when the batch and
    # the features have one size
    square = jnp.asarray(X[:16, :1] * np.arange(16) + X[:16, 1:2])
    rows = jnp.arange(16) < 11
    per_sample = jaxddp.SyncBatchNorm(16, comm=SELF, rngs=nnx.Rngs(0))(square, mask=rows)
    flax_rows = nnx.BatchNorm(16, rngs=nnx.Rngs(0))(square, mask=rows[:, None])
    np.testing.assert_allclose(per_sample, flax_rows, rtol=1e-5, atol=1e-5)
