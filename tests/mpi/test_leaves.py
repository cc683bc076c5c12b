"""Every kind of leaf gets a right answer or an error naming it, on real ranks (2 and 4):
typed PRNG keys, bool, complex, float16 and bfloat16, inside ``jax.jit`` and outside it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxddp

MPI_SIZES = (2, 4)

rank = jaxddp.rank()
size = jaxddp.world_size()

JIT = pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])


def _run(f, jit):
    return jax.jit(f) if jit else f


def _is_key(x):
    return jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _key_data(tree):
    """The tree with every typed key replaced by its key data, to compare values."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.rngs = rngs


def _model(seed, calls):
    """A model whose parameters and keys come from ``seed``, its dropout stream advanced
    ``calls`` times (so the keys' counters differ too)."""
    model = _Model(nnx.Rngs(params=seed, dropout=100 + seed))
    for _ in range(calls):
        model.dropout(jnp.ones(4))
        model.rngs.dropout()
    return model


# --- typed PRNG keys -------------------------------------------------------------------------


@JIT
def test_synchronize_gives_every_rank_roots_nnx_state_keys_included(jit):
    root = size - 1
    model = _model(seed=rank, calls=rank)
    state = _run(lambda s: jaxddp.synchronize(s, root), jit)(nnx.state(model))
    nnx.update(model, state)
    got = nnx.state(model)
    want = nnx.state(_model(seed=root, calls=root))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    keys = [x for x in jax.tree.leaves(got) if _is_key(x)]
    assert len(keys) == 3  # the model's two streams and the dropout's own
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        if _is_key(b):
            assert jax.random.key_impl(a) == jax.random.key_impl(b)
        np.testing.assert_array_equal(_key_data(a), _key_data(b))


@JIT
def test_broadcast_moves_keys_of_any_shape_and_impl(jit):
    tree = {
        "one": jax.random.key(rank),
        "many": jax.random.split(jax.random.key(10 + rank), (2, 3)),
        "rbg": jax.random.key(rank, impl="rbg"),
        "raw": jax.random.PRNGKey(rank),  # a legacy uint32 key is just an array
    }
    out = _run(lambda t: jaxddp.broadcast(t, root=1), jit)(tree)
    want = {
        "one": jax.random.key(1),
        "many": jax.random.split(jax.random.key(11), (2, 3)),
        "rbg": jax.random.key(1, impl="rbg"),
        "raw": jax.random.PRNGKey(1),
    }
    for name, key in want.items():
        assert out[name].dtype == key.dtype, name
        assert out[name].shape == key.shape, name
        np.testing.assert_array_equal(_key_data(out[name]), _key_data(key))


@JIT
@pytest.mark.parametrize("call", ["allreduce", "reduce", "allreduce_gradients"])
def test_reductions_refuse_keys_naming_the_leaf(call, jit):
    tree = {"w": jnp.ones(3), "rng": {"key": jax.random.key(rank)}}
    if call == "allreduce":
        f = jaxddp.allreduce
    elif call == "reduce":
        f = lambda t: jaxddp.reduce(t, "sum")
    else:
        tx = jaxddp.allreduce_gradients()
        f = lambda t: tx.update(t, tx.init(None))[0]
    with pytest.raises(TypeError, match=r"\['rng'\]\['key'\].*key<fry>.*synchronize"):
        _run(f, jit)(tree)
    # nothing was sent: the next collective pairs up as usual
    assert float(jaxddp.allreduce({"x": 1.0}, "sum")["x"]) == size


# --- bool ------------------------------------------------------------------------------------


def _flags(r):
    return {
        "any": jnp.array([r == 0, True, False, r % 2 == 1]),
        "nan": jnp.isnan(jnp.where(r == 1, jnp.nan, 1.0)),
    }


def _bool_expected(op):
    stacked = jax.tree.map(
        lambda *xs: np.stack([np.asarray(x) for x in xs]), *[_flags(r) for r in range(size)]
    )
    reduce = {
        "max": lambda x: x.any(axis=0),
        "min": lambda x: x.all(axis=0),
        "sum": lambda x: x.sum(axis=0, dtype=np.int32),
        "mean": lambda x: x.mean(axis=0, dtype=np.float32),
    }[op]
    return jax.tree.map(reduce, stacked)


_BOOL_DTYPES = {"max": np.bool_, "min": np.bool_, "sum": np.int32, "mean": np.float32}


@JIT
@pytest.mark.parametrize("op", ["max", "min", "sum", "mean"])
def test_allreduce_of_bool_leaves(op, jit):
    out = _run(lambda t: jaxddp.allreduce(t, op), jit)(_flags(rank))
    for name, want in _bool_expected(op).items():
        assert np.asarray(out[name]).dtype == _BOOL_DTYPES[op], name
        np.testing.assert_allclose(np.asarray(out[name]), want, rtol=1e-6)


@JIT
@pytest.mark.parametrize("op", ["max", "min", "sum", "mean"])
def test_reduce_of_bool_leaves(op, jit):
    root = size - 1
    out = _run(lambda t: jaxddp.reduce(t, op, root=root), jit)(_flags(rank))
    if rank == root:
        want, dtype = _bool_expected(op), _BOOL_DTYPES[op]
    else:  # the other ranks get their own leaves back
        want, dtype = jax.tree.map(np.asarray, _flags(rank)), np.bool_
    for name in want:
        assert np.asarray(out[name]).dtype == dtype, name
        np.testing.assert_allclose(np.asarray(out[name]), want[name], rtol=1e-6)


@JIT
def test_broadcast_of_bool_leaves(jit):
    out = _run(lambda t: jaxddp.broadcast(t, root=1), jit)(_flags(rank))
    for name, want in _flags(1).items():
        assert np.asarray(out[name]).dtype == np.bool_
        np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(want))


# --- complex ---------------------------------------------------------------------------------


@JIT
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("call", ["allreduce", "reduce"])
def test_complex_max_and_min_are_refused_naming_the_leaf(call, op, jit):
    tree = {"ok": jnp.ones(2), "z": [jnp.ones(2, jnp.complex64) * (1 + 1j) * rank]}
    f = (
        (lambda t: jaxddp.allreduce(t, op))
        if call == "allreduce"
        else (lambda t: jaxddp.reduce(t, op))
    )
    with pytest.raises(ValueError, match=rf"\['z'\]\[0\].*complex64.*{op}"):
        _run(f, jit)(tree)
    total = _run(lambda t: jaxddp.allreduce(t, "sum"), jit)(tree)  # sums still work
    np.testing.assert_allclose(np.asarray(total["z"][0]), (1 + 1j) * sum(range(size)))


# --- float16 and bfloat16 ------------------------------------------------------------------------


@JIT
@pytest.mark.parametrize("call", ["allreduce", "reduce"])
def test_half_precision_means_are_computed_in_float32(call, jit):
    tree = {
        # their sum overflows float16 (max 65504), their mean does not
        "f16": jnp.full(3, 60000.0, jnp.float16),
        # 1 + r/128: a running sum in bfloat16 (8 significant bits) would round
        "bf16": jnp.full(5, 1 + rank / 128, jnp.bfloat16),
    }
    if call == "allreduce":
        out = _run(lambda t: jaxddp.allreduce(t, "mean"), jit)(tree)
    else:
        out = _run(lambda t: jaxddp.reduce(t, "mean", root=0), jit)(tree)
    if call == "reduce" and rank != 0:
        want = tree
    else:
        bf16 = np.mean([np.float32(np.asarray(jnp.bfloat16(1 + r / 128))) for r in range(size)])
        want = {
            "f16": np.full(3, 60000.0, np.float16),
            "bf16": np.full(5, bf16, np.float32).astype(jnp.bfloat16),
        }
    for name in want:
        assert np.asarray(out[name]).dtype == np.asarray(want[name]).dtype, name
        np.testing.assert_array_equal(
            np.asarray(out[name]).astype(np.float32), np.asarray(want[name]).astype(np.float32)
        )


@JIT
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_masked_mean_of_half_precision_accumulates_in_float32(dtype, jit):
    values = jnp.full(4096, 20.0 + rank, dtype)  # 4096 * 20 overflows float16
    mask = jnp.arange(4096) < 4000
    out = _run(jaxddp.masked_mean, jit)(values, mask)
    assert np.asarray(out).dtype == np.dtype(dtype)
    want = np.float32(np.mean([20.0 + r for r in range(size)]))
    assert float(out) == float(np.asarray(want).astype(dtype))


# --- chunks ----------------------------------------------------------------------------------


@JIT
def test_buffers_over_the_count_limit_travel_in_chunks(monkeypatch, jit):
    """The chunking of leaves past 2**31 elements, with a limit of 7 elements per call."""
    monkeypatch.setattr(jaxddp._collectives.wire, "MAX_COUNT", 7)
    tree = {
        "a": jnp.arange(30, dtype=jnp.int32).reshape(5, 6) * (rank + 1),
        "b": jnp.arange(3.0) + rank,
        "flags": jnp.arange(20) % (rank + 2) == 0,
    }
    total = _run(lambda t: jaxddp.allreduce(t, "sum"), jit)(tree)
    ranks = range(size)
    np.testing.assert_array_equal(
        total["a"], np.arange(30).reshape(5, 6) * sum(r + 1 for r in ranks)
    )
    np.testing.assert_array_equal(total["b"], np.arange(3.0) * size + sum(ranks))
    np.testing.assert_array_equal(total["flags"], sum(np.arange(20) % (r + 2) == 0 for r in ranks))
    moved = _run(lambda t: jaxddp.broadcast(t, root=1), jit)(tree)
    np.testing.assert_array_equal(moved["a"], np.arange(30).reshape(5, 6) * 2)
    np.testing.assert_array_equal(moved["flags"], np.arange(20) % 3 == 0)
