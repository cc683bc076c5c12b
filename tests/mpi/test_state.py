"""Model state besides the parameters stays identical across ranks."""

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
WORLD = MPI.COMM_WORLD


def _everyone(tree):
    """Every rank's leaves, as NumPy: a list (one per rank) of lists of leaves."""
    return WORLD.allgather([np.asarray(x) for x in jax.tree.leaves(tree)])


def _identical(tree):
    everyone = _everyone(tree)
    return all(
        all(np.array_equal(a, b) for a, b in zip(everyone[0], other, strict=True))
        for other in everyone
    )


class Net(nnx.Module):
    def __init__(self, rngs):
        self.inner = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.norm(self.inner(x))))


def _batch(step):
    """A batch that differs between ranks (and steps)."""
    rng = np.random.default_rng([step, rank])
    x = rng.normal(loc=rank, size=(16, 4)).astype(np.float32)
    return x, x.sum(1)


@pytest.mark.parametrize("average", [True, False], ids=["averaged", "left alone"])
def test_nnx_batch_stats_stay_identical_over_five_steps_only_when_averaged(average):
    model = Net(nnx.Rngs(0))
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jaxddp.masked_mean((m(x)[:, 0] - y) ** 2, jnp.ones(16, bool)))(
            model
        )
        optimizer.update(model, grads)
        before = nnx.state(model, nnx.BatchStat)
        if average:
            nnx.update(model, jaxddp.average_state(before))
        return before

    for i in range(5):
        before = step(model, optimizer, *_batch(i))
    assert _identical(nnx.state(model, nnx.Param))  # the gradient sync alone does this
    assert _identical(nnx.state(model)) is average  # the batch statistics too, if averaged
    if average:  # and they are the ranks' mean, at the last step
        everyone = _everyone(before)
        mean = [np.mean(np.stack(leaves), 0) for leaves in zip(*everyone, strict=True)]
        for got, want in zip(jax.tree.leaves(nnx.state(model, nnx.BatchStat)), mean, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_linen_batch_stats_averaged_outside_jit_as_jax_arrays():
    class Norm(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False)(x)

    x, _ = _batch(0)
    variables = Norm().init(jax.random.key(0), x)
    _, updated = Norm().apply(variables, x, mutable=["batch_stats"])
    stats = updated["batch_stats"]
    assert not _identical(stats)
    averaged = jaxddp.average_state(stats)
    assert _identical(averaged)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(averaged))
    everyone = _everyone(stats)
    for got, *per_rank in zip(jax.tree.leaves(averaged), *everyone, strict=True):
        np.testing.assert_allclose(got, np.mean(np.stack(per_rank), 0), rtol=1e-6)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_only_floating_leaves_are_averaged(jit):
    tree = {
        "stat": jnp.full(3, float(rank)),
        "half": jnp.full(2, rank, jnp.bfloat16),
        "count": jnp.int32(rank),
        "flag": jnp.bool_(rank == 0),
        "key": jax.random.key(rank),
    }
    got = jax.jit(jaxddp.average_state)(tree) if jit else jaxddp.average_state(tree)
    mean = (size - 1) / 2
    np.testing.assert_allclose(got["stat"], np.full(3, mean))
    assert got["half"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got["half"], np.float32), np.full(2, mean))
    assert int(got["count"]) == rank  # integers, booleans and keys pass unchanged
    assert bool(got["flag"]) == (rank == 0)
    np.testing.assert_array_equal(jax.random.key_data(got["key"]), jax.random.key_data(tree["key"]))
    assert jaxddp.average_state({"name": "norm", "n": 3}) == {"name": "norm", "n": 3}
