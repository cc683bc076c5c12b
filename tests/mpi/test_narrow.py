"""Gradient compression's narrow allreduce: jaxddp's pipelined CPU handler
(``jaxddp/_native/narrow.cc``) against the composition of moves it replaces on CPU
(``jaxddp/_collectives/_jax/narrow.py``), bit for bit, at 2, 3 and 4 ranks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxddp
from jaxddp import _native
from jaxddp._collectives._jax import narrow as _narrow
from jaxddp._collectives._jax import ops
from jaxddp._runtime.world import jax_comm

MPI_SIZES = (2, 3, 4)  # 3: a mean that is no power of two

rank = jaxddp.rank()
size = jaxddp.world_size()
NARROW = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


@pytest.mark.parametrize(("narrow", "mean"), [("bf16", True), ("fp16", True), ("bf16", False)])
def test_the_pipelined_handler_equals_the_composition(narrow, mean):
    """jaxddp's CPU handler (narrow.cc: the leaves read where they lie, in chunks rounded
    while earlier ones travel) gives the bits of the alltoall-and-allgather composition that
    GPUs and the xla path run: with and without a residual, over several chunks, leaves that
    a chunk spans, an empty leaf, a length no world size divides, saturation, float16's
    subnormals, infinities and NaNs, negative zeros; at 3 ranks a mean's 1/3 too (XLA
    multiplies by a scalar's inverse and fuses multiply-adds: the composition rounds where
    the handler does)."""
    rng = np.random.default_rng(rank)

    def values(n):
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-9, 6, n)).astype(np.float32)

    shapes = [(700, 1000), (0,), (3,), (600_002,)]  # several chunks per rank at 2 and 4 ranks
    xs = [values(int(np.prod(s))).reshape(s) for s in shapes]
    xs[0][0, :4] = [1e6, -1e6, 3e-7, -0.0]  # beyond float16, a float16 subnormal, -0
    xs[0][0, 5 + rank] = np.inf if rank % 2 else np.nan
    xs = [jnp.asarray(x) for x in xs]
    residual = jnp.asarray(values(sum(x.size for x in xs)) * np.float32(1e-3))
    comm, dtype = jax_comm(), NARROW[narrow]
    handler = jax.jit(lambda xs, r: ops.narrow_allreduce(xs, r, dtype, mean, comm))

    def moves(v, r):
        return _narrow.composed(
            v, r, dtype, mean,
            alltoall=lambda x: ops.MPI_PATH.alltoall([x], comm)[0],
            allgather=lambda x: ops.MPI_PATH.allgather([x], comm)[0],
            size=size, me=rank,
        )  # fmt: skip

    composed = jax.jit(moves)
    for r in (residual, None):
        if _native.narrow_target() is not None:  # jaxddp's handlers in use: it is the handler
            assert "jaxddp_narrow_allreduce" in handler.lower(xs, r).as_text()
        (got, error), (want, want_error) = handler(xs, r), composed(xs, r)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.isnan(np.asarray(got[0])[0, 5])
        if r is None:
            assert error is None
            assert want_error is None
        else:
            np.testing.assert_array_equal(np.asarray(error), np.asarray(want_error))
            assert np.all(np.isfinite(np.asarray(error)))
