"""The communicator module in a single process (no launcher): a world of 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxddp


def test_world_of_one_without_a_launcher():
    assert (jaxddp.rank(), jaxddp.world_size(), jaxddp.local_rank()) == (0, 1, 0)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_allreduce_of_one_rank_keeps_values(op):
    tree = {"a": jnp.arange(4.0), "b": (jnp.int32(3),)}
    out = jax.jit(lambda t: jaxddp.allreduce(t, op=op))(tree)
    np.testing.assert_array_equal(out["a"], tree["a"])
    assert int(out["b"][0]) == 3
    assert out["a"].dtype == jnp.float32


def test_allreduce_rejects_unknown_op():
    with pytest.raises(ValueError, match=r"`op`.*'prod'"):
        jaxddp.allreduce({"a": jnp.ones(2)}, op="prod")
