"""Every collective's signature agreed across ranks: a rank passing another dtype, shape,
tree, ``op`` or ``root`` is a TreeMismatchError on every rank, in and outside ``jax.jit``,
never garbage, MPI's own "Message truncated" abort or a hang."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxddp
from jaxddp._collectives import signature as _signature

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
odd = rank == size - 1  # the one rank that calls differently
last = size - 1


def _mode(jit):
    return jax.jit if jit else lambda f: f


def _still_works():
    """The communicators are clean after the error: the next collectives give the right sums."""
    out = jaxddp.allreduce({"x": jnp.float32(rank + 1)}, op="sum")
    assert float(out["x"]) == size * (size + 1) / 2
    out = jax.jit(lambda t: jaxddp.allreduce(t, op="sum"))({"x": jnp.float32(rank + 1)})
    assert float(out["x"]) == size * (size + 1) / 2


JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


@JIT
def test_a_dtype_differing_on_one_rank_raises_on_every_rank(jit):
    # same byte count: MPI used to add float32 bits to int32 bits (1.5 and 1069547527)
    x = {"w": jnp.ones(3, jnp.int32 if odd else jnp.float32)}
    pattern = rf"at `\['w'\]`: rank 0 has float32\[3\].*rank {last} has int32\[3\]"
    with pytest.raises(jaxddp.TreeMismatchError, match=pattern):
        _mode(jit)(lambda t: jaxddp.allreduce(t, op="sum"))(x)
    _still_works()


@JIT
def test_an_op_differing_on_one_rank_raises_on_every_rank(jit):
    op = "max" if odd else "sum"
    pattern = rf"`op` differs \(rank 0: 'sum', .*rank {last}: 'max'\)"
    with pytest.raises(jaxddp.TreeMismatchError, match=pattern):
        _mode(jit)(lambda t: jaxddp.allreduce(t, op=op))({"w": jnp.ones(2)})
    _still_works()


@JIT
def test_a_shape_differing_on_one_rank_raises_on_every_rank(jit):
    # more elements on one rank: MPI aborted the job with "Message truncated"
    x = {"w": jnp.ones(5 if odd else 3)}
    pattern = rf"rank 0 has float32\[3\].*rank {last} has float32\[5\]"
    with pytest.raises(jaxddp.TreeMismatchError, match=pattern):
        _mode(jit)(jaxddp.allreduce)(x)
    _still_works()


@JIT
def test_a_tree_differing_on_one_rank_raises_on_every_rank(jit):
    x = {"w": jnp.ones(3)}
    if odd:
        x["b"] = jnp.ones(2)
    pattern = rf"at `\['b'\]`: rank 0 has nothing.*rank {last} has float32\[2\]"
    with pytest.raises(jaxddp.TreeMismatchError, match=pattern):
        _mode(jit)(jaxddp.allreduce)(x)
    _still_works()


@JIT
def test_a_root_differing_on_one_rank_raises_on_every_rank(jit):
    # a reduce onto another root on one rank used to hang until the stall inspector ended it
    root = 1 if odd else 0
    pattern = rf"`root` differs \(rank 0: 0, .*rank {last}: 1\)"
    with pytest.raises(jaxddp.TreeMismatchError, match=pattern):
        _mode(jit)(lambda t: jaxddp.reduce(t, "sum", root=root))({"w": jnp.ones(2)})
    with pytest.raises(jaxddp.TreeMismatchError, match=pattern):
        _mode(jit)(lambda t: jaxddp.broadcast(t, root=root))({"w": jnp.ones(2)})
    _still_works()


def test_different_collectives_are_named():
    x = {"w": jnp.ones(2)}
    call = (lambda t: jaxddp.reduce(t, "sum")) if odd else jaxddp.allreduce
    pattern = rf"the collective differs \(rank 0: 'allreduce', .*rank {last}: 'reduce'\)"
    with pytest.raises(jaxddp.TreeMismatchError, match=pattern):
        call(x)
    _still_works()


def test_masked_mean_of_samples_of_another_shape_raises_on_every_rank():
    values = np.ones((4, 3 if odd else 2), np.float32)
    mask = np.ones(4, bool)
    pattern = rf"rank 0 has float64\[2\].*rank {last} has float64\[3\]"
    with pytest.raises(jaxddp.TreeMismatchError, match=pattern):
        jaxddp.masked_mean(values, mask)
    _still_works()


def test_jitted_checks_run_once_per_compilation_eager_ones_every_call(monkeypatch):
    traced, eager = [], []
    exchange, gather = _signature._exchange, _signature._gather
    monkeypatch.setattr(_signature, "_exchange", lambda *a: (traced.append(1), exchange(*a))[1])
    monkeypatch.setattr(_signature, "_gather", lambda *a: (eager.append(a[2]), gather(*a))[1])
    step = jax.jit(lambda t: jaxddp.allreduce(t, op="sum"))
    for i in range(10):
        out = step({"w": jnp.full(3, float(rank + i))})
    assert (len(traced), len(eager)) == (1, 0)  # traced once: one check, at trace time
    np.testing.assert_allclose(out["w"], sum(r + 9 for r in range(size)))
    for i in range(5):
        out = jaxddp.allreduce({"w": np.float32(rank + i), "n": np.float32(1)}, op="sum")
        assert float(out["w"]) == sum(r + i for r in range(size))
        assert float(out["n"]) == size
    # outside jit: one message per call, the two float32 in it (nothing after it)
    assert (len(traced), len(eager)) == (1, 5)
    assert all(payload is not None and payload.nbytes == 8 for payload in eager)
    out = jaxddp.allreduce({"big": np.full(100, rank, np.float32)}, op="max")
    assert eager[-1] is None  # too big to travel with the check: sent after it
    np.testing.assert_array_equal(out["big"], size - 1)
    mean = jaxddp.masked_mean(np.arange(4.0) + rank, np.array([True, True, True, rank > 0]))
    assert eager[-1] is not None  # the sum and the count, with the check
    values = [v + r for r in range(size) for v in range(4) if v < 3 or r > 0]
    np.testing.assert_allclose(mean, np.mean(values), rtol=1e-6)


def test_off_with_the_environment(monkeypatch):
    monkeypatch.setenv("JAXDDP_CHECK", "0")
    _signature.enabled.cache_clear()  # read once per process: read it again
    try:
        seen = []
        monkeypatch.setattr(_signature, "_gather", lambda *a: seen.append(1))
        out = jaxddp.allreduce({"w": np.float32(rank)}, op="sum")
        assert float(out["w"]) == sum(range(size))
        assert seen == []
    finally:
        monkeypatch.undo()
        _signature.enabled.cache_clear()
    assert _signature.enabled()
