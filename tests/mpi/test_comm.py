"""The world's shape and pytree allreduce, on real ranks (2 and 4)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_rank_and_size_match_the_launcher():
    assert size == int(os.environ["PMI_SIZE"])
    assert rank == int(os.environ["PMI_RANK"])
    assert size > 1


def test_local_rank_matches_the_launcher():
    assert jaxddp.local_rank() == int(os.environ["MPI_LOCALRANKID"])


def _ours():
    """The FFI target of jaxddp's own allreduce in this launch's programs (on a GPU, or on
    the CPU where this launch runs the GPU's handlers, the staged one)."""
    from jaxddp import _native

    on_gpu = jax.default_backend() == "gpu" or _native.cpu_staged()
    return _native.gpu_target("allreduce") if on_gpu else _native.TARGET


def test_jitted_allreduces_run_jaxddps_own_handler_on_every_rank():
    # The suite runs with JAXDDP_NATIVE_ALLREDUCE on (its default) on a host with a C++
    # compiler: every jitted allreduce of tests/mpi goes through jaxddp/_native.
    from jaxddp import _native

    assert _native.allreduce_target() == _native.TARGET, _native.status()
    staged = os.environ.get("JAXDDP_TEST_STAGED") == "1"
    assert _native.cpu_staged() == staged, _native.gpu_status()
    x = jnp.arange(105674, dtype=jnp.float32) * (rank + 1)
    f = jax.jit(lambda x: jaxddp.allreduce(x, op="sum"))
    assert f'custom_call_target="{_ours()}"' in f.lower(x).compile().as_text()
    want = np.arange(105674, dtype=np.float32) * sum(r + 1 for r in range(size))
    np.testing.assert_array_equal(f(x), want)
    _native._share_on(False)  # and through MPI, where ranks span nodes
    try:
        np.testing.assert_array_equal(f(x), want)
    finally:
        _native._share_on(True)


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


def test_concrete_values_take_the_host_path_and_come_back_as_numpy():
    tree = {
        "loss": jnp.float32(rank + 0.5),
        "hits": np.array([rank, 1], np.int32),
        "half": jnp.full(3, rank + 1, jnp.bfloat16),
        "big": np.full(300_000, rank, np.float32),  # travels alone
        "n": rank,
    }
    out = jaxddp.allreduce(tree, op="sum")
    assert all(isinstance(x, np.ndarray | np.generic) for x in jax.tree.leaves(out))
    assert float(out["loss"]) == sum(r + 0.5 for r in range(size))
    np.testing.assert_array_equal(out["hits"], [sum(range(size)), size])
    assert out["half"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(out["half"].astype(np.float32), [size * (size + 1) / 2] * 3)
    np.testing.assert_array_equal(out["big"], np.full(300_000, sum(range(size))))
    assert int(out["n"]) == sum(range(size))
    mean = jaxddp.allreduce(tree, op="mean")
    assert mean["hits"].dtype == np.float32  # an integer mean is float32, as in jit
    np.testing.assert_allclose(mean["hits"], [np.mean(range(size)), 1.0])
    jitted = jax.jit(lambda t: jaxddp.allreduce(t, op="mean"))(tree)
    for a, b in zip(jax.tree.leaves(mean), jax.tree.leaves(jitted), strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_masked_mean_on_concrete_values_matches_the_jitted_one():
    values = jnp.arange(10.0) * (rank + 1)
    mask = jnp.arange(10) < 7 - rank  # each rank has a different number of real entries
    eager = jaxddp.masked_mean(values, mask)
    jitted = jax.jit(jaxddp.masked_mean)(values, mask)
    assert isinstance(eager, np.ndarray | np.generic)
    total = sum(np.arange(10.0)[: 7 - r].sum() * (r + 1) for r in range(size))
    count = sum(7 - r for r in range(size))
    np.testing.assert_allclose(eager, total / count, rtol=1e-6)
    np.testing.assert_allclose(jitted, total / count, rtol=1e-6)
    assert np.asarray(eager).dtype == np.float32
    nothing = jaxddp.masked_mean(values, jnp.zeros(10, bool))
    assert np.isnan(nothing)


def test_masked_mean_differentiates_under_jax_checkpoint():
    # Before, jax.checkpoint (remat) refused the collective's effect: NotImplementedError
    # "Effects not supported in AD of `checkpoint`/`remat`" (mpi4jax's ordered effect)
    x = jnp.arange(4.0) + rank
    mask = jnp.array([True, True, rank == 0, True])

    def loss(w):
        return jaxddp.masked_mean((x * w) ** 2, mask)

    w = jnp.float32(1.5)
    want = jax.jit(jax.grad(loss))(w)  # this rank's share, as without the checkpoint
    xs = np.concatenate([np.arange(4.0) + r for r in range(size)])
    kept = np.concatenate([[True, True, r == 0, True] for r in range(size)])
    whole = 2 * 1.5 * np.sum(xs[kept] ** 2) / kept.sum()  # d/dw of the mean of (x w)^2
    nothing_saved = jax.checkpoint_policies.nothing_saveable
    for f in (
        jax.jit(jax.grad(jax.checkpoint(loss))),
        jax.grad(jax.checkpoint(loss)),  # the checkpoint staged outside any jit
        jax.jit(jax.grad(jax.checkpoint(loss, policy=nothing_saved))),
    ):
        got = f(w)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(jaxddp.allreduce(np.asarray(got), "mean"), whole, rtol=1e-6)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_broadcast_and_reduce_keep_the_kind_of_each_leaf(jit):
    tree = {"w": jnp.arange(3.0) + rank, "step": rank, "name": "mlp"}
    run = jax.jit if jit else (lambda f: f)
    out = run(lambda t: jaxddp.broadcast(t, root=size - 1))(
        tree if not jit else {k: v for k, v in tree.items() if k != "name"}
    )
    np.testing.assert_array_equal(out["w"], np.arange(3.0) + size - 1)
    assert int(out["step"]) == size - 1
    if not jit:
        assert isinstance(out["w"], jax.Array)
        assert out["step"] == size - 1
        assert isinstance(out["step"], int)
        assert out["name"] == "mlp"
    total = run(lambda t: jaxddp.reduce(t, "sum", root=0))({"w": tree["w"]})
    expected = np.arange(3.0) * size + sum(range(size)) if rank == 0 else np.arange(3.0) + rank
    np.testing.assert_array_equal(total["w"], expected)


# The shared-memory allreduce (jaxddp/_native): every dtype and op jaxddp's allreduce sends.
_WIRE = [("float32", op) for op in ("sum", "max", "min")] + [("complex64", "sum")]
_WIRE += [
    (f"{s}int{b}", op) for s in ("", "u") for b in (8, 16, 32) for op in ("sum", "max", "min")
]
_WIRE_64 = [("float64", "sum"), ("float64", "max"), ("complex128", "sum"), ("int64", "sum")]
_WIRE_64 += [("uint64", "min"), ("int64", "max")]


def _part(r, dtype, n):
    """Rank r's input: integers over the dtype's whole range (sums wrap), or normals."""
    rng = np.random.default_rng([r, n, len(dtype)])
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    values = rng.standard_normal(n)
    if np.dtype(dtype).kind == "c":
        values = values + 1j * rng.standard_normal(n)
    return values.astype(dtype)


def _in_rank_order(dtype, op, n):
    """Every rank's input reduced by NumPy, rank 0's first (integer sums wrap, as MPI's)."""
    reduce = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    out = _part(0, dtype, n)
    with np.errstate(over="ignore"):
        for r in range(1, size):
            out = reduce(out, _part(r, dtype, n))
    return out


def _through_shared_memory(wire, n=37):
    from jaxddp import _native

    for dtype, op in wire:
        x = jnp.asarray(_part(rank, dtype, n))
        before = _native.shared_calls()
        got = jax.jit(lambda x, op=op: jaxddp.allreduce(x, op=op))(x).block_until_ready()
        # this rank's count is exact; another rank may already be one call further
        assert _native.shared_calls()[rank] == before[rank] + 1, (dtype, op)
        # the same bits as NumPy's reduction in rank order, on every rank
        np.testing.assert_array_equal(got, _in_rank_order(dtype, op, n), err_msg=f"{dtype} {op}")
        assert got.dtype == np.dtype(dtype)
        _native._share_on(False)  # MPI's, for comparison
        try:
            mpi = jax.jit(lambda x, op=op: jaxddp.allreduce(x, op=op))(x).block_until_ready()
        finally:
            _native._share_on(True)
        assert _native.shared_calls()[rank] == before[rank] + 1
        if op == "sum" and np.dtype(dtype).kind in "fc":  # MPI may add in another order
            np.testing.assert_allclose(mpi, got, rtol=1e-6, atol=1e-6, err_msg=f"{dtype} {op}")
        else:
            np.testing.assert_array_equal(mpi, got, err_msg=f"{dtype} {op} through MPI")


def test_on_one_node_jitted_allreduces_reduce_in_shared_memory():
    from jaxddp import _native

    assert "in memory they share" in _native.status()
    _through_shared_memory(_WIRE)
    jax.config.update("jax_enable_x64", True)
    try:
        _through_shared_memory(_WIRE_64)
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("op", ["max", "min"])
def test_a_nan_on_any_rank_is_the_max_and_the_min_on_every_rank(op):
    # as jnp.maximum and jnp.minimum have it, whichever rank holds it (MPI's own max keeps
    # the first rank's value where a later rank has the NaN, or the other way round)
    from jaxddp import _native

    x = np.zeros(size + 1, np.float32) + rank
    x[rank] = np.nan
    before = _native.shared_calls()
    got = jax.jit(lambda x: jaxddp.allreduce(x, op=op))(x).block_until_ready()
    assert _native.shared_calls()[rank] == before[rank] + 1
    want = np.full(size + 1, size - 1 if op == "max" else 0, np.float32)
    want[:size] = np.nan
    np.testing.assert_array_equal(got, want)


def test_an_allreduce_larger_than_the_shared_slots_goes_through_them_in_turn():
    from jaxddp import _native

    n = 3 * _native.SLOT_BYTES // 4 + 5  # float32: three slots and 20 bytes
    before = _native.shared_calls()
    got = jax.jit(lambda x: jaxddp.allreduce(x, op="sum"))(_part(rank, "float32", n))
    got.block_until_ready()  # dispatch may return before the call has run
    assert _native.shared_calls()[rank] == before[rank] + 4
    np.testing.assert_array_equal(got, _in_rank_order("float32", "sum", n))


def test_ranks_that_call_different_allreduces_get_an_error_naming_both():
    # jaxddp's signature check would catch this first; without it (check=False), the
    # shared-memory allreduce compares the calls itself instead of adding 3 numbers to 4.
    from jaxddp._collectives.api import reduce_all

    n = 3 if rank == 0 else 4
    f = jax.jit(lambda x: reduce_all(x, "sum", check=False))
    with pytest.raises(Exception, match="called different allreduces") as error:
        f(jnp.ones(n, jnp.float32)).block_until_ready()
    other = 1 if rank == 0 else 0
    assert f"rank {rank} reduces {n} float32 (sum)" in str(error.value)
    assert f"rank {other} reduces {3 if other == 0 else 4} float32 (sum)" in str(error.value)
    # and the ranks go on in step
    np.testing.assert_array_equal(
        jax.jit(lambda x: jaxddp.allreduce(x, "sum"))(jnp.ones(2)), [size] * 2
    )


def _everyone(value):
    """Every rank's ``value``, in rank order (to assert on every rank alike)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather(value)


def _nan_input(n, dtype=np.float32):
    """A NaN on rank 0 at element 0 and on the last rank at element 1; else rank + 1."""
    x = np.full(n, rank + 1.0, dtype)
    x[0] = np.nan if rank == 0 else x[0]
    x[1] = np.nan if rank == size - 1 else x[1]
    return x


_NAN_PATHS = [
    "jit-shared",  # jaxddp's handler, in shared memory
    "jit-mpi",  # jaxddp's handler, through MPI (where ranks span nodes)
    "jit-mpi4jax",  # mpi4jax's handler (JAXDDP_NATIVE_ALLREDUCE=0, other platforms)
    "eager-small",  # a few metrics: with the signature check, reduced by every rank
    "eager-unchecked",  # the same without the check: one MPI Allreduce
    "eager-large",  # 3.2 MB: an MPI Allreduce after the check
    "eager-float64",
    "reduce-eager",
    "reduce-jit",
]


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("path", _NAN_PATHS)
def test_a_nan_on_any_rank_is_the_max_and_the_min_on_every_path(op, path, monkeypatch):
    # one rule on every path, as np.maximum has it: MPI's MAX of a 3.2 MB float32 array
    # with a NaN on rank 0 gave rank 1's 1.0
    from jaxddp import _native
    from jaxddp._collectives.api import reduce_all

    n = {"eager-small": 3, "eager-unchecked": 3, "eager-large": 800_000}.get(path, 1000)
    x = _nan_input(n, np.float64 if path == "eager-float64" else np.float32)
    if path == "jit-mpi4jax":
        monkeypatch.setattr(_native, "allreduce_target", lambda: None)
        monkeypatch.setattr(_native, "cpu_staged", lambda: False)
        monkeypatch.setattr(_native, "gpu_target", lambda kind: None)
    if path == "jit-mpi":
        _native._share_on(False)
    try:
        if path.startswith("jit"):
            f = jax.jit(lambda x: jaxddp.allreduce(x, op=op))
            hlo = f.lower(jnp.asarray(x)).compile().as_text()
            got = np.asarray(f(jnp.asarray(x)))
            assert (f'"{_ours()}"' in hlo) == (path != "jit-mpi4jax")
        elif path == "eager-unchecked":
            got = reduce_all(x, op, check=False)
        elif path == "reduce-eager":
            got = jaxddp.reduce(x, op, root=0)
        elif path == "reduce-jit":
            got = np.asarray(jax.jit(lambda x: jaxddp.reduce(x, op, root=0))(jnp.asarray(x)))
        else:
            got = jaxddp.allreduce(x, op=op)
    finally:
        _native._share_on(True)
    got = np.asarray(got)
    want = size if op == "max" else 1.0
    ok = bool(np.isnan(got[:2]).all() and (got[2:] == want).all())
    if path.startswith("reduce") and rank != 0:
        ok = bool(np.array_equal(got, x, equal_nan=True))  # its own values back
    assert _everyone(ok) == [True] * size


_MISMATCHES = {
    # rank 0's leaf, every other rank's leaf, the op of rank 0 and of the others
    "bfloat16-float32": (jnp.ones(3, jnp.bfloat16), jnp.ones(3, jnp.float32), "sum", "sum"),
    "complex-float": (jnp.ones(5, jnp.complex64), jnp.ones(10, jnp.float32), "sum", "sum"),
    "mean-sum": (jnp.ones(2, jnp.float32), jnp.ones(2, jnp.float32), "mean", "sum"),
    "empty-five": (jnp.ones(0, jnp.float32), jnp.ones(5, jnp.float32), "sum", "sum"),
}


@pytest.mark.parametrize("case", list(_MISMATCHES))
def test_unchecked_mismatches_in_shared_memory_are_an_error_on_every_rank(case):
    # Without jaxddp's signature check (check=False, as JAXDDP_CHECK=0), the shared-memory
    # allreduce compares the call as its caller made it: the dtype asked for, the op (mean
    # included), the shape, and a call of no element takes part. These gave 3 against 3,
    # 3+2j against [3, 2, ...], 1.5 against 3.0, and a hang.
    from jaxddp._collectives.api import reduce_all

    mine, others, op0, op = _MISMATCHES[case]
    x, op = (mine, op0) if rank == 0 else (others, op)
    f = jax.jit(lambda x: reduce_all(x, op, check=False))
    try:
        out = f(x).block_until_ready()
        seen = f"no error: {np.asarray(out).tolist()}"
    except Exception as error:  # noqa: BLE001 - compared on every rank below
        seen = str(error)
    everyone = _everyone(seen)
    for text in everyone:
        assert "called different allreduces" in text, everyone
    expected = {"empty-five": "float32[0]", "mean-sum": "mean of float32[2]"}.get(case)
    if expected is not None:
        assert expected in everyone[0], everyone
    # and the ranks go on in step
    np.testing.assert_array_equal(
        jax.jit(lambda x: jaxddp.allreduce(x, "sum"))(jnp.ones(2)), [size] * 2
    )
