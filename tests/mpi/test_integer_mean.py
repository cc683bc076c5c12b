"""``"mean"`` of integer leaves is exact at the dtype limits: summed wide, then divided.

It used to sum in the leaf's own dtype and wrap before dividing: int8 ``[100, 100]`` on
2 ranks gave -28.0, int32 2e9 gave -147483648.0, in and outside jit and in ``reduce``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxddp

MPI_SIZES = (2, 4)

rank = jaxddp.rank()
size = jaxddp.world_size()

# 64-bit integers need jax_enable_x64 in JAX; outside jit NumPy has them anyway
HOST_ONLY = ("int64", "uint64")
DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", *HOST_ONLY)


def _values(dtype):
    """Each rank's leaf at the limits: [max - rank, min + rank, max, min, rank]."""
    info = np.iinfo(dtype)
    return np.array(
        [int(info.max) - rank, int(info.min) + rank, info.max, info.min, rank], dtype=dtype
    )


def _expected(dtype):
    everyone = [[int(np.iinfo(dtype).max) - r, int(np.iinfo(dtype).min) + r] for r in range(size)]
    info = np.iinfo(dtype)
    columns = [
        [e[0] for e in everyone],
        [e[1] for e in everyone],
        [int(info.max)] * size,
        [int(info.min)] * size,
        list(range(size)),
    ]
    # Python integers: the exact mean, rounded once to float32
    return np.array([np.float32(sum(c) / size) for c in columns], np.float32)


@pytest.mark.parametrize("where", ["eager", "jit"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_integer_mean_is_exact_at_the_dtype_limits(dtype, where):
    if where == "jit" and dtype in HOST_ONLY:
        x = np.asarray(_values(dtype))  # JAX would truncate it to 32 bits: host only
        got = jaxddp.allreduce({"x": x}, op="mean")["x"]
    else:
        x = jnp.asarray(_values(dtype)) if where == "jit" else _values(dtype)
        mean = lambda t: jaxddp.allreduce(t, op="mean")
        got = (jax.jit(mean) if where == "jit" else mean)({"x": x})["x"]
    assert np.asarray(got).dtype == np.float32
    np.testing.assert_allclose(np.asarray(got), _expected(dtype), rtol=1.2e-7, atol=0)


@pytest.mark.parametrize("where", ["eager", "jit"])
@pytest.mark.parametrize("dtype", ["int8", "uint16", "int32", "uint32"])
def test_integer_mean_in_reduce_is_exact_on_root_and_leaves_the_others_alone(dtype, where):
    x = _values(dtype)
    leaf = jnp.asarray(x) if where == "jit" else x
    mean = lambda t: jaxddp.reduce(t, "mean", root=size - 1)
    got = np.asarray((jax.jit(mean) if where == "jit" else mean)({"x": leaf})["x"])
    if rank == size - 1:
        np.testing.assert_allclose(got, _expected(dtype), rtol=1.2e-7, atol=0)
    else:  # not root: its own values, in their own dtype, exactly
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, x)


def test_the_reported_overflows():
    # the reported cases, 2 ranks' worth of values on every rank
    cases = {"int8": 100, "uint8": 200, "int16": 30000, "int32": 2_000_000_000}
    for dtype, value in cases.items():
        leaf = np.array([value], dtype)
        eager = jaxddp.allreduce(leaf, op="mean")
        jitted = jax.jit(lambda t: jaxddp.allreduce(t, op="mean"))(jnp.asarray(leaf))
        assert float(eager[0]) == float(np.float32(value)), dtype
        assert float(jitted[0]) == float(np.float32(value)), dtype
