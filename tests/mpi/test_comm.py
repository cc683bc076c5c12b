"""The world's shape and pytree allreduce, on real ranks (2 and 4)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxddp

MPI_SIZES = (2, 4)

rank = jaxddp.rank()
size = jaxddp.world_size()


def test_rank_and_size_match_the_launcher():
    assert size == int(os.environ["PMI_SIZE"])
    assert rank == int(os.environ["PMI_RANK"])
    assert size > 1


def test_local_rank_matches_the_launcher():
    assert jaxddp.local_rank() == int(os.environ["MPI_LOCALRANKID"])


def _tree(r):
    """A nested tree whose values depend on the rank r."""
    return {
        "dense": {"w": jnp.full((3, 2), r + 1.0, jnp.float32), "b": jnp.arange(2.0) * r},
        "pair": (jnp.int32(r + 1), jnp.array([r, -r, 7], jnp.int32)),
    }


def _expected(op):
    trees = [jax.tree.map(np.asarray, _tree(r)) for r in range(size)]
    reduce = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
    return jax.tree.map(lambda *xs: reduce(np.stack(xs), axis=0), *trees)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_allreduce_pytree(op, jit):
    f = lambda t: jaxddp.allreduce(t, op=op)
    out = (jax.jit(f) if jit else f)(_tree(rank))
    expected = _expected(op)
    assert jax.tree.structure(out) == jax.tree.structure(expected)
    for got, want, orig in zip(
        jax.tree.leaves(out), jax.tree.leaves(expected), jax.tree.leaves(_tree(0)), strict=True
    ):
        assert got.shape == orig.shape
        want_dtype = (
            orig.dtype if op != "mean" or jnp.issubdtype(orig.dtype, jnp.floating) else jnp.float32
        )
        assert got.dtype == want_dtype
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_allreduce_is_identical_on_every_rank():
    out = jax.jit(jaxddp.allreduce)({"x": jnp.float32(rank) / 3.0})
    everyone = jaxddp.allreduce({"x": out["x"]}, op="max")
    assert float(everyone["x"]) == float(out["x"])
