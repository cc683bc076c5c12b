"""The handlers of jaxddp's collectives in programs for a GPU (jaxddp/_native/staged.cc), as far
as a machine without one can test them: run at 2 ranks as on a GPU (the ordered path, every
jitted collective through them), their host side on the CPU against the stand-in CUDA
driver (tests/native/driver.c, whose copies happen only when the stream is waited for), and
the programs lowered for CUDA checked against what the handlers take.

The other modules of this launch (test_comm, test_exact, test_sharded, ...: their "staged"
variant) run their own tests through the same handlers.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import jaxddp
from jaxddp import _native
from jaxddp._collectives._jax import ops
from jaxddp._native import staged
from jaxddp._runtime.world import jax_comm

MPI_SIZES = (2,)
MPI_VARIANTS = {
    "staged": {
        "JAXDDP_TEST_STAGED": "1",
        "JAXDDP_TEST_CUDA_DRIVER": "<stand-in CUDA driver>",
        "JAXDDP_TEST_COLLECTIVE_PATH": "ordered",
    }
}
MPI_VARIANT_SIZES = {"staged": (2,)}
MPI_VARIANTS_ONLY = True

rank = jaxddp.rank()
size = jaxddp.world_size()
STAGE_ITEMS = (8 << 20) // 4  # float32 elements in one chunk of staged.cc (kStageBytes)


def _every_kind(x):
    comm = jax_comm()
    (a,) = ops.allreduce_many([x], MPI.SUM, comm, calls=["a sum"])
    (b,) = ops.bcast_many([x], 0, comm)
    (c,) = ops.reduce_many([x], MPI.SUM, 0, comm)
    (d,) = ops.allgather_many([x], comm)
    (e,) = ops.alltoall_many([jnp.stack([x] * size)], comm)
    return a, b, c, d, e


_CALL = re.compile(r"stablehlo\.custom_call @(\w+)\((.*?)\) \{.*?mhlo\.backend_config = \{(.*?)\}")


def _calls(text):
    """(target, operand count, {attribute: value}) of every custom call of a lowered module."""
    found = []
    for target, operands, attrs in _CALL.findall(text):
        values = dict(re.findall(r"(\w+) = (\"[^\"]*\"|-?\d+)", attrs))
        found.append((target, len(operands.split(",")), values))
    return found


def test_every_kind_lowers_for_cuda_to_its_staged_handler_with_the_attributes_it_takes():
    assert _native.cpu_staged(), _native.gpu_status()
    x = jnp.arange(4.0, dtype=jnp.float32)
    traced = jax.jit(_every_kind).trace(x)
    cuda = _calls(traced.lower(lowering_platforms=("cuda",)).as_text())
    cpu = _calls(traced.lower(lowering_platforms=("cpu",)).as_text())
    assert [target for target, _, _ in cuda] == [staged.target(k) for k in staged.KINDS]
    for (target, operands, attrs), kind in zip(cuda, staged.KINDS, strict=True):
        # what the handler's binding takes (staged.cc), no more, no less
        assert sorted(attrs) == sorted(staged.attributes(_native._library, kind)), target
        assert operands == 2, target  # the buffer and the token
    # the CPU's binding of the same handlers, which this launch runs, gets the same calls
    assert cuda == cpu


def test_on_mpi4jaxs_route_its_cuda_handlers_are_told_to_stage_through_host(monkeypatch):
    # Without jaxddp's handlers, a GPU program calls mpi4jax's CUDA targets, which hand MPI
    # the GPU buffers unless told otherwise; mpi4jax tells them in its own lowering only,
    # which jaxddp's collectives do not use: every multi-rank GPU step crashed so.
    from mpi4jax._src.xla_bridge import HAS_CUDA_EXT

    monkeypatch.setattr(_native, "gpu_target", lambda kind: None)
    x = jnp.arange(4.0, dtype=jnp.float32)
    # JAX caches a function's lowering by its jaxpr (a fresh jax.jit of the same function
    # finds it on jax 0.12), so the lowering made with jaxddp's handlers goes first, and the
    # one made here goes after, for the tests that follow
    jax.clear_caches()
    try:
        lowered = jax.jit(_every_kind).trace(x).lower(lowering_platforms=("cuda",))
    finally:
        jax.clear_caches()
    targets = [target for target, _, _ in _calls(lowered.as_text())]
    assert targets == [f"mpi_{k}_ffi" for k in staged.KINDS]
    if HAS_CUDA_EXT:  # this machine's mpi4jax build has it where nvcc was found
        from mpi4jax._src.xla_bridge import mpi_xla_bridge_cuda

        assert mpi_xla_bridge_cuda.get_copy_to_host() is True


def _standin():
    import ctypes

    return ctypes.CDLL(os.environ["JAXDDP_TEST_CUDA_DRIVER"])


@pytest.mark.parametrize("n", [0, 1, STAGE_ITEMS, 2 * STAGE_ITEMS + 3])
def test_every_kind_is_right_in_chunks_and_leaves_no_copy_or_context_behind(n):
    # 2 * STAGE_ITEMS + 3 goes in three chunks, the next one copied while one is reduced
    x = (jnp.arange(n, dtype=jnp.float32) % 1000) * (rank + 1)
    driver = _standin()
    copies = driver.jaxddp_standin_copies()
    a, b, c, d, e = (np.asarray(v) for v in jax.jit(_every_kind)(x))
    base = np.arange(n, dtype=np.float32) % 1000
    total = base * sum(r + 1 for r in range(size))
    np.testing.assert_array_equal(a, total)
    np.testing.assert_array_equal(b, base)  # rank 0's
    np.testing.assert_array_equal(c, total if rank == 0 else base * (rank + 1))
    np.testing.assert_array_equal(d, np.stack([base * (r + 1) for r in range(size)]))
    np.testing.assert_array_equal(e, np.stack([base * (r + 1) for r in range(size)]))
    assert driver.jaxddp_standin_pending() == 0  # every copy waited for
    assert driver.jaxddp_standin_depth() == 0  # every context pushed was popped
    if n > 0:
        assert driver.jaxddp_standin_copies() > copies


def test_pinned_memory_stays_within_two_chunks_each_way_for_the_chunked_kinds():
    x = jnp.ones(5 * STAGE_ITEMS, jnp.float32)
    out = jax.jit(lambda x: jaxddp.allreduce(x, op="sum"))(x)
    np.testing.assert_array_equal(np.asarray(out[:3]), [size] * 3)
    pinned = _native._library.jaxddp_native_staged_pinned()
    # two chunks each way, of which one each way also holds the largest allgather or
    # alltoall of the tests before, whole (its bytes rounded up to a MiB)
    largest = -(-4 * size * (2 * STAGE_ITEMS + 3) // (1 << 20)) * (1 << 20)
    assert pinned <= 2 * (8 << 20) + 2 * largest, pinned


def test_a_float_maximum_keeps_a_nan_and_a_mean_is_exact_through_the_staging():
    x = np.arange(10, dtype=np.float32) + rank
    x[rank] = np.nan
    got = np.asarray(jax.jit(lambda x: jaxddp.allreduce(x, op="max"))(jnp.asarray(x)))
    assert np.isnan(got[:size]).all()
    np.testing.assert_array_equal(got[size:], np.arange(size, 10) + size - 1)
    mean = jax.jit(lambda x: jaxddp.allreduce(x, op="mean"))(jnp.full(7, rank, jnp.float32))
    np.testing.assert_allclose(np.asarray(mean), (size - 1) / 2)


def test_a_gpu_program_with_no_handler_for_its_collectives_is_an_error_naming_the_fix(
    monkeypatch,
):
    from jaxddp._collectives._jax import compat

    monkeypatch.setattr(_native, "gpu_target", lambda kind: None)
    monkeypatch.setattr(compat, "mpi4jax_has_cuda", lambda: False)
    fresh = jax.jit(lambda x: jaxddp.allreduce(x, op="sum") + 1)
    with pytest.raises(RuntimeError, match="cannot run in a program for a GPU") as error:
        fresh.trace(jnp.ones(3)).lower(lowering_platforms=("cuda",))
    assert "JAXDDP_NATIVE_ALLREDUCE" in str(error.value)
    assert "CUDA_ROOT" in str(error.value)
