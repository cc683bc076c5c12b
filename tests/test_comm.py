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


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize(
    ("op", "dtype", "value"),
    [("max", np.bool_, [True, False]), ("min", np.bool_, [True, False]),
     ("sum", np.int32, [1, 0]), ("mean", np.float32, [1.0, 0.0])],
)  # fmt: skip
def test_bool_leaves_of_one_rank(op, dtype, value, jit):
    f = lambda t: jaxddp.allreduce(t, op)
    out = (jax.jit(f) if jit else f)({"flags": jnp.array([True, False])})
    assert np.asarray(out["flags"]).dtype == dtype
    np.testing.assert_array_equal(np.asarray(out["flags"]), value)
    on_root = (
        jax.jit(lambda t: jaxddp.reduce(t, op)) if jit else (lambda t: jaxddp.reduce(t, op))
    )({"flags": jnp.array([True, False])})
    assert np.asarray(on_root["flags"]).dtype == dtype


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_keys_and_complex_order_are_refused_naming_the_leaf(jit):
    run = jax.jit if jit else (lambda f: f)
    with pytest.raises(TypeError, match=r"`allreduce` cannot reduce the PRNG key at `\['k'\]`"):
        run(jaxddp.allreduce)({"k": jax.random.key(0)})
    with pytest.raises(ValueError, match=r"`reduce` with op='max' got a complex leaf at `\[1\]`"):
        run(lambda t: jaxddp.reduce(t, "max"))([1.0, jnp.ones(2, jnp.complex64)])
    key = jax.random.key(3)
    out = run(jaxddp.synchronize)({"k": key})
    np.testing.assert_array_equal(jax.random.key_data(out["k"]), jax.random.key_data(key))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_masked_mean_of_float16_accumulates_in_float32(jit):
    values = jnp.full(4096, 20.0, jnp.float16)  # a float16 sum overflows at 65504
    mask = jnp.ones(4096, bool)
    out = (jax.jit(jaxddp.masked_mean) if jit else jaxddp.masked_mean)(values, mask)
    assert np.asarray(out).dtype == np.float16
    assert float(out) == 20.0


def test_describe_tree_names_key_dtypes():
    from jaxddp._collectives.consistency import describe_tree

    assert describe_tree({"k": jax.random.split(jax.random.key(0), 3)}) == [
        ("['k']", "key<fry>[3]")
    ]


def test_large_buffers_travel_in_chunks_mpi_can_count():
    from jaxddp._collectives.wire import MAX_COUNT, chunks

    assert MAX_COUNT == 2**31 - 1
    assert chunks(0) == [(0, 0)]
    assert chunks(MAX_COUNT) == [(0, MAX_COUNT)]
    assert chunks(2 * MAX_COUNT + 1) == [
        (0, MAX_COUNT), (MAX_COUNT, 2 * MAX_COUNT), (2 * MAX_COUNT, 2 * MAX_COUNT + 1)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "leaf", ["relu", jax.nn.relu, np.array(["a", "b"])], ids=["string", "function", "string-array"]
)
def test_a_leaf_that_is_not_numbers_is_refused_naming_its_path(leaf):
    tree = {"w": jnp.ones(2), "name": leaf}
    with pytest.raises(TypeError, match=r"`allreduce` got a .* at `\['name'\]`.*eqx\.filter"):
        jaxddp.allreduce(tree)
    if not isinstance(leaf, np.ndarray):  # reduce gives non-arrays back, as documented
        assert jaxddp.reduce(tree, "sum", root=0)["name"] is leaf
