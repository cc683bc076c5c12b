"""A rank whose batch is only padding contributes nothing and breaks nothing.

The sampler gives rank ``j`` no real sample in the last batch when ``j >= N mod (W*B) > 0``:
here ``N = 3*W*B + W//2`` (194 at 4 x 16, 193 at 2 x 32), so the upper half of the ranks
end every epoch on a batch of padding alone. The one-process reference runs on every rank
itself, on ``MPI.COMM_SELF``, with Flax's own batch norm.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from mpi4py import MPI

import jaxddp

MPI_SIZES = (2, 4)

rank = jaxddp.rank()
size = jaxddp.world_size()
WORLD, SELF = MPI.COMM_WORLD, MPI.COMM_SELF

GLOBAL_BATCH, FEATURES, EPOCHS = 64, 5, 3
B = GLOBAL_BATCH // size
N = 3 * GLOBAL_BATCH + size // 2  # the last global batch: fewer real samples than ranks

_data = np.random.default_rng(3)
X = (_data.normal(size=(N, FEATURES)) * 3 + 1).astype(np.float32)
Y = _data.normal(size=(N, 1)).astype(np.float32)


RNGS = functools.partial(nnx.Rngs, 0)


def _allgather(tree):
    return WORLD.allgather([np.asarray(x) for x in jax.tree.leaves(tree)])


def _identical(tree):
    everyone = _allgather(tree)
    return all(
        all(np.array_equal(a, b, equal_nan=True) for a, b in zip(everyone[0], other, strict=True))
        for other in everyone
    )


def _assert_close(got, expected, atol=1e-6, rtol=0.0):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def test_the_last_batch_of_the_upper_ranks_is_only_padding():
    sampler = jaxddp.DistributedSampler(N, seed=1)
    last = list(sampler.batches(B))[-1][1]
    real = WORLD.allgather(int(last.sum()))
    assert real == [1] * (size // 2) + [0] * (size - size // 2)


# ---- NNX: SyncBatchNorm against one process's nnx.BatchNorm --------------------------------


class NormNet(nnx.Module):
    def __init__(self, norm, rngs):
        # no bias before the norm: its gradient is 0 up to rounding, which Adam turns into
        # steps of +-lr in directions that differ between any two summation orders
        self.inner = nnx.Linear(FEATURES, 8, use_bias=False, rngs=rngs)
        self.norm = norm(8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, mask):
        return self.head(jax.nn.relu(self.norm(self.inner(x), mask=mask[:, None])))


def _loss(model, x, y, mask, comm):
    return jaxddp.masked_mean(jnp.sum((model(x, mask) - y) ** 2, -1), mask, comm=comm)


def _train_nnx(norm, comm):
    """EPOCHS shuffled epochs with the global batch 64 over ``comm``; the whole state, and
    the synced gradient of the first step of the last batch (only padding on some ranks)."""
    model = NormNet(norm, RNGS())
    tx = optax.chain(jaxddp.allreduce_gradients(comm=comm), optax.adam(1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    sync = jaxddp.allreduce_gradients(comm=comm)

    @nnx.jit
    def step(model, optimizer, x, y, mask):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y, mask, comm)
        optimizer.update(model, grads)
        return loss, sync.update(grads, sync.init(None))[0]

    sampler = jaxddp.DistributedSampler(N, seed=1, comm=comm)
    losses, last_grads = [], None
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for indices, mask in sampler.batches(GLOBAL_BATCH // comm.Get_size()):
            loss, grads = step(model, optimizer, X[indices], Y[indices], mask)
            losses.append(float(loss))
        if last_grads is None:
            last_grads = grads
    return nnx.state(model), np.array(losses), last_grads


@pytest.mark.parametrize("fast_variance", [False, True], ids=["two-pass", "fast"])
def test_sync_batch_norm_with_padding_only_ranks_trains_as_one_process(fast_variance):
    sync = functools.partial(jaxddp.SyncBatchNorm, use_fast_variance=fast_variance)
    flax = functools.partial(nnx.BatchNorm, use_fast_variance=fast_variance)
    state, losses, grads = _train_nnx(sync, WORLD)
    one_state, one_losses, one_grads = _train_nnx(flax, SELF)
    assert _identical(state)  # parameters and running statistics, without average_state
    assert np.all(np.isfinite(losses))
    # The two-pass variance is exact to rounding, but a last batch of 1 or 2 real samples
    # has a variance near 0, where d rsqrt(var + eps) / d var is -eps**-1.5 / 2: the
    # earlier steps' rounding (4 partial sums of 16 against one sum of 64) comes out
    # amplified there. Seen: within 1e-6 on an earlier host, 2.6e-5 (relative) on an AVX2
    # EPYC (the order XLA sums in follows the CPU's vector width). E[x**2] - E[x]**2
    # amplifies it more (Flax against Flax in another summation order differs as much), so
    # the fast form is held to what it can give. Padding counted as data (tried at 4
    # ranks) moves the losses by up to 2.3.
    tol = 1e-3 if fast_variance else 1e-4
    np.testing.assert_allclose(losses, one_losses, rtol=tol, atol=tol)  # order 1: 0.07-3.3
    _assert_close(grads, one_grads, atol=tol, rtol=tol)  # the step that is padding on some
    _assert_close(state, one_state, atol=tol, rtol=tol)


# ---- linen: LinenSyncBatchNorm against one process's nn.BatchNorm -------------------------


class LinenNet(nn.Module):
    norm: type
    comm: object = None

    @nn.compact
    def __call__(self, x, mask, train=True):
        hidden = nn.Dense(8, use_bias=False)(x)
        kwargs = {"comm": self.comm} if self.norm is jaxddp.LinenSyncBatchNorm else {}
        norm = self.norm(
            use_running_average=not train, use_fast_variance=False, name="norm", **kwargs
        )
        hidden = norm(hidden, mask=mask[:, None])
        return nn.Dense(1)(nn.relu(hidden))


def _train_linen(norm, comm):
    model = LinenNet(norm, comm)
    variables = model.init(jax.random.key(0), X[:2], np.ones(2, bool), train=False)
    tx = optax.chain(jaxddp.allreduce_gradients(comm=comm), optax.adam(1e-2))
    opt_state = tx.init(variables["params"])

    @jax.jit
    def step(variables, opt_state, x, y, mask):
        def loss_fn(p):
            out, updated = model.apply(
                {"params": p, "batch_stats": variables["batch_stats"]},
                x,
                mask,
                mutable=["batch_stats"],
            )
            per_sample = jnp.sum((out - y) ** 2, -1)
            return jaxddp.masked_mean(per_sample, mask, comm=comm), updated["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        return {"params": params, "batch_stats": stats}, opt_state, loss

    sampler = jaxddp.DistributedSampler(N, seed=1, comm=comm)
    losses = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for indices, mask in sampler.batches(GLOBAL_BATCH // comm.Get_size()):
            variables, opt_state, loss = step(variables, opt_state, X[indices], Y[indices], mask)
            losses.append(float(loss))
    return variables, np.array(losses)


def test_linen_sync_batch_norm_with_padding_only_ranks_trains_as_one_process():
    variables, losses = _train_linen(jaxddp.LinenSyncBatchNorm, WORLD)
    one, one_losses = _train_linen(nn.BatchNorm, SELF)
    assert _identical(variables)  # batch_stats too, without average_state
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    assert jax.tree.structure(variables) == jax.tree.structure(one)  # Flax's variables
    _assert_close(variables, one, atol=1e-6)


# ---- the local-statistics path: Flax's batch norm per rank, averaged ----------------------


class LocalNet(nnx.Module):
    def __init__(self, rngs):
        self.inner = nnx.Linear(FEATURES, 8, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, stats_mask):
        return self.head(jax.nn.relu(self.norm(self.inner(x), mask=stats_mask[:, None])))


@pytest.mark.parametrize("recipe", [True, False], ids=["docs' recipe", "sampler's mask"])
def test_local_batch_norm_on_a_padding_only_rank_is_finite_with_the_documented_mask(recipe):
    model = LocalNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2)), wrt=nnx.Param
    )

    @nnx.jit
    def step(model, optimizer, x, y, mask):
        # the docs' recipe: a rank with no real sample takes its statistics from its
        # padding (real samples of the data set), so they are finite; the loss ignores them
        stats_mask = mask | ~mask.any() if recipe else mask

        def loss_fn(model):
            per_sample = jnp.sum((model(x, stats_mask) - y) ** 2, -1)
            return jaxddp.masked_mean(per_sample, mask)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        nnx.update(model, jaxddp.average_state(nnx.state(model, nnx.BatchStat)))
        return loss

    sampler = jaxddp.DistributedSampler(N, seed=1)
    losses = []
    for indices, mask in sampler.batches(B):
        losses.append(float(step(model, optimizer, X[indices], Y[indices], mask)))
    state = nnx.state(model)
    finite = all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(state))
    assert _identical(state)
    # Flax's batch norm divides by a count of 0 on a rank whose batch is only padding: its
    # gradient is nan, and the average spreads it to every rank. The recipe prevents that.
    assert finite == recipe
    assert np.all(np.isfinite(losses[:-1]))


# ---- masked_mean where some ranks have no real sample ------------------------------------


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_masked_mean_and_its_gradient_on_ranks_without_a_real_sample(jit):
    sampler = jaxddp.DistributedSampler(N, shuffle=False)
    indices, mask = list(sampler.batches(B))[-1]
    values = jnp.asarray(X[indices, 0])
    mean = jax.jit(jaxddp.masked_mean) if jit else jaxddp.masked_mean
    grad = jax.grad(lambda v: jaxddp.masked_mean(v**2, jnp.asarray(mask)))
    grad = jax.jit(grad) if jit else grad
    got, g = float(mean(values, mask)), np.asarray(grad(values))
    real = X[3 * GLOBAL_BATCH :, 0]  # the last global batch's real samples
    np.testing.assert_allclose(got, real.mean(), rtol=1e-6)
    assert np.all(np.isfinite(g))
    if not mask.any():
        assert np.all(g == 0)  # a rank with nothing real gets no gradient, not nan
    else:  # psum's rule: size times its share of the one-process gradient
        np.testing.assert_allclose(g[mask], size * 2 * values[mask] / len(real), rtol=1e-6)


# ---- every rank starts the same pass ------------------------------------------------------


def test_ranks_in_different_epochs_are_an_error_on_every_rank():
    sampler = jaxddp.DistributedSampler(N, seed=1)
    sampler.set_epoch(1 + int(rank == size - 1))
    expected = r"`epoch` \(rank 0: 1, .*" + rf"rank {size - 1}: 2\)"
    with pytest.raises(ValueError, match=rf"same pass.*{expected}.*set_epoch"):
        sampler.batches(B)
    with pytest.raises(ValueError, match=rf"same pass.*{expected}"):
        iter(sampler)
    sampler.set_epoch(3)  # the same everywhere again: the pass goes ahead
    counts = WORLD.allgather(len(list(sampler.batches(B))))
    assert counts == [counts[0]] * size


def test_ranks_with_different_batch_sizes_are_an_error_on_every_rank():
    sampler = jaxddp.DistributedSampler(N, seed=1)
    mine = 8 if rank == 0 else 9
    with pytest.raises(ValueError, match=r"`batch_size` \(rank 0: 8, rank 1: 9"):
        sampler.batches(mine)
    with pytest.raises(ValueError, match=r"`batch_size` \(rank 0: 'iteration', rank 1: 8"):
        iter(sampler) if rank == 0 else sampler.batches(8)
    drop = rank == 0
    with pytest.raises(ValueError, match=r"`drop_last` of `batches` \(rank 0: True, rank 1: Fa"):
        sampler.batches(8, drop_last=drop)
    # a failed check consumed nothing: the state is still the epoch's start
    assert sampler.state_dict()["position"] == 0


def test_a_named_jax_axis_is_refused_by_both_sync_batch_norms():
    with pytest.raises(ValueError, match="not a named JAX axis: drop `axis_name='batch'`"):
        jaxddp.SyncBatchNorm(3, axis_name="batch", rngs=RNGS())
    norm = jaxddp.LinenSyncBatchNorm(use_running_average=False, axis_name="batch")
    with pytest.raises(ValueError, match="not a named JAX axis"):
        norm.init(jax.random.key(0), jnp.ones((2, 3)))
