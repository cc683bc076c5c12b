"""resolve_unused_parameters and allreduce_gradients in one process (a world of one)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxddp


class Layer(NamedTuple):
    w: jax.Array
    b: jax.Array


def _assert_zeros_like(x, param):
    assert x.shape == param.shape
    assert x.dtype == param.dtype
    assert not np.any(np.asarray(x))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_none_becomes_zeros_beside_a_present_leaf(jit):
    params = {"a": jnp.ones((2, 3)), "b": jnp.ones(4)}
    grads = {"a": jnp.full((2, 3), 0.5), "b": None}
    resolve = jax.jit(jaxddp.resolve_unused_parameters) if jit else jaxddp.resolve_unused_parameters
    out = resolve(grads, params)
    np.testing.assert_array_equal(out["a"], grads["a"])
    _assert_zeros_like(out["b"], params["b"])


def test_a_whole_layer_of_none_in_nested_dicts_and_namedtuples():
    params = {
        "enc": Layer(jnp.ones((3, 2)), jnp.ones(2)),
        "dec": {"l1": Layer(jnp.ones((2, 2)), jnp.zeros(2)), "l2": [jnp.ones(5), jnp.ones(1)]},
    }
    grads = {"enc": Layer(jnp.full((3, 2), 2.0), None), "dec": None}
    out = jaxddp.resolve_unused_parameters(grads, params)
    assert jax.tree.structure(out) == jax.tree.structure(params)
    np.testing.assert_array_equal(out["enc"].w, 2.0)
    _assert_zeros_like(out["enc"].b, params["enc"].b)
    for got, param in zip(jax.tree.leaves(out["dec"]), jax.tree.leaves(params["dec"]), strict=True):
        _assert_zeros_like(got, param)


def test_no_op_when_every_gradient_is_present():
    params = {"a": jnp.ones(3), "b": (jnp.ones(2), jnp.ones(1))}
    grads = {"a": jnp.arange(3.0), "b": (jnp.arange(2.0), jnp.arange(1.0))}
    out = jaxddp.resolve_unused_parameters(grads, params)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(grads), strict=True):
        assert got is want


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


def test_float32_and_float64_keep_shapes_and_dtypes(x64):
    params = {"f32": jnp.ones((2, 2), jnp.float32), "f64": jnp.ones((3,), jnp.float64)}
    assert params["f64"].dtype == jnp.float64
    out = jaxddp.resolve_unused_parameters({"f32": None, "f64": None}, params)
    _assert_zeros_like(out["f32"], params["f32"])
    _assert_zeros_like(out["f64"], params["f64"])


def test_missing_keys_become_zeros():
    params = {"shared": jnp.ones(2), "expert0": jnp.ones(3), "expert1": jnp.ones(3)}
    out = jaxddp.resolve_unused_parameters({"shared": jnp.ones(2), "expert1": jnp.ones(3)}, params)
    assert set(out) == set(params)
    _assert_zeros_like(out["expert0"], params["expert0"])


def test_float0_cotangents_of_integer_parameters_become_zeros():
    params = {"w": jnp.ones(3), "step": jnp.int32(7)}
    grads = jax.grad(lambda p: jnp.sum(p["w"] * p["step"]), allow_int=True)(params)
    assert grads["step"].dtype == jax.dtypes.float0
    out = jaxddp.resolve_unused_parameters(grads, params)
    _assert_zeros_like(out["step"], params["step"])
    np.testing.assert_array_equal(out["w"], 7.0)


def test_a_filtered_nnx_state():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(3, 4, rngs=rngs)
            self.head = nnx.Linear(4, 2, rngs=rngs)

    model = Model(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    only_head = nnx.All(nnx.Param, nnx.PathContains("head"))
    grads = nnx.grad(
        lambda m: jnp.sum(m.head(m.body(jnp.ones((1, 3))))),
        argnums=nnx.DiffState(0, only_head),
    )(model)
    out = jaxddp.resolve_unused_parameters(grads, params)
    assert jax.tree.structure(out) == jax.tree.structure(params)
    _assert_zeros_like(out["body"]["kernel"][...], params["body"]["kernel"][...])
    assert np.any(np.asarray(out["head"]["kernel"][...]))


def test_shape_mismatch_names_the_path():
    params = {"layer": {"w": jnp.ones((2, 3))}}
    with pytest.raises(ValueError, match=r"\['layer'\]\['w'\].*\(3, 2\).*\(2, 3\)"):
        jaxddp.resolve_unused_parameters({"layer": {"w": jnp.ones((3, 2))}}, params)


def test_a_gradient_without_a_parameter_names_the_path():
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"\['stray'\]"):
        jaxddp.resolve_unused_parameters({"w": jnp.ones(2), "stray": jnp.ones(2)}, params)


def test_allreduce_gradients_in_a_chain_under_jit():
    params = {"w": jnp.ones(3), "frozen": jnp.ones(2)}
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.sgd(1.0))
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)({"w": jnp.arange(3.0), "frozen": None}, state, params)
    np.testing.assert_array_equal(updates["w"], -jnp.arange(3.0))
    _assert_zeros_like(updates["frozen"], params["frozen"])


def test_missing_gradients_without_params_say_to_pass_params():
    tx = jaxddp.allreduce_gradients()
    with pytest.raises(ValueError, match=r"`params`"):
        tx.update({"w": None, "v": jnp.ones(1)}, tx.init(None))


def test_present_gradients_need_no_params():
    tx = jaxddp.allreduce_gradients(op="sum")
    updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(None))
    np.testing.assert_array_equal(updates["w"], 1.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"op": "avg"}, ValueError, r"`op`.*'avg'"),
        ({"check": "yes"}, TypeError, r"`check`.*'yes'"),
    ],
)
def test_bad_arguments_are_refused_by_the_factory(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        jaxddp.allreduce_gradients(**kwargs)


def test_check_on_one_rank_passes():
    params = {"w": jnp.ones(2)}
    tx = jaxddp.allreduce_gradients(check=True)
    updates, _ = jax.jit(tx.update)({"w": jnp.ones(2)}, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], 1.0)


def test_synchronize_and_broadcast_keep_non_array_leaves():
    tree = {"w": jnp.ones(2), "name": "mlp", "step": 3, "fn": len}
    out = jaxddp.synchronize(tree)
    assert out["name"] == "mlp"
    assert out["step"] == 3
    assert out["fn"] is len
    np.testing.assert_array_equal(out["w"], 1.0)


def test_describe_tree_and_mismatch_message():
    from jaxddp._collectives.consistency import _explain, describe_tree

    a = describe_tree({"w": jnp.ones((2, 3)), "b": jnp.ones(3)})
    b = describe_tree({"w": jnp.ones((2, 3))})
    message = _explain([a, b], "gradient tree")
    assert "`['b']`" in message
    assert "rank 0 has float32[3]" in message
    assert "rank 1 has nothing" in message


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_whole_model_as_params_names_the_leaf_and_the_equinox_fix(jit):
    # what a whole Equinox model holds besides arrays: its activation, a custom_jvp
    params = {"linear": {"weight": jnp.ones((2, 2))}, "activation": jax.nn.relu}
    grads = {"linear": {"weight": jnp.ones((2, 2))}, "activation": None}
    tx = jaxddp.allreduce_gradients()
    update = lambda g: tx.update(g, tx.init(None), params)
    update = jax.jit(update) if jit else update
    with pytest.raises(TypeError, match=r"at `\['activation'\]`.*eqx\.filter\(model, eqx\.is_"):
        update(grads)
    # only the arrays, as the message says: fine
    arrays = {"linear": params["linear"], "activation": None}
    updates, _ = tx.update(grads, tx.init(None), arrays)
    assert updates["linear"]["weight"].shape == (2, 2)
