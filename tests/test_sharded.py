"""jaxddp.shard_optimizer in one process (a world of one): the packing, the full state and
the refusals. On real ranks: tests/mpi/test_sharded.py."""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxddp
from jaxddp._collectives import api as _comm
from jaxddp._collectives._jax import ops as _ops
from jaxddp._training.zero.slices import layout_of as _layout

PARAMS = {
    "w": jnp.arange(12.0).reshape(3, 4),
    "empty": jnp.zeros((0, 2)),
    "half": jnp.linspace(-1, 1, 5, dtype=jnp.bfloat16),
    "b": jnp.ones(3),
    "z": jnp.array([1 + 2j, 3 - 1j], jnp.complex64),
}


def _grads(step):
    return jax.tree.map(lambda p: (p + 0.5) * (step + 1) * 0.1, PARAMS)


def _close(a, b, tol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.complex64), np.asarray(y, np.complex64), tol)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_the_layout_packs_every_dtype_into_one_padded_vector_and_back(size):
    leaves = jax.tree.leaves(PARAMS)
    slices = []
    for rank in range(size):
        layout = _layout(PARAMS, rank, size)
        assert [d.name for d, _ in layout.groups] == ["float32", "bfloat16", "complex64"]
        packed = layout.pack(leaves)
        for vector, length in zip(packed, layout.lengths, strict=True):
            assert vector.size % size == 0
            assert vector.size - length < size  # padding: fewer than W elements
            assert not np.asarray(vector[length:]).any()  # zeros
        slices.append(layout.mine(packed))
        _close(layout.unpack(packed), PARAMS)
    whole = [jnp.concatenate([s[g] for s in slices]) for g in range(3)]
    _close(_layout(PARAMS, 0, size).unpack(whole), PARAMS)  # the slices tile the vectors


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize(
    "inner",
    [optax.adam(1e-2), optax.adamw(1e-2), optax.sgd(0.1, momentum=0.9),
     optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(0.1, 0.0, 4))],
    ids=["adam", "adamw", "momentum", "injected-schedule"],
)  # fmt: skip
def test_one_process_equals_the_unsharded_chain_and_its_full_state(inner, jit):
    real = {k: v for k, v in PARAMS.items() if k != "z"}  # adamw's decay is real
    tx, ref = jaxddp.shard_optimizer(inner), optax.chain(jaxddp.allreduce_gradients(), inner)
    state, ref_state, ours, theirs = tx.init(real), ref.init(real), real, real
    f = jax.jit if jit else (lambda g: g)
    for step in range(3):
        grads = {k: v for k, v in _grads(step).items() if k != "z"}
        updates, state = f(tx.update)(grads, state, ours)
        ours = optax.apply_updates(ours, updates)
        updates, ref_state = f(ref.update)(grads, ref_state, theirs)
        theirs = optax.apply_updates(theirs, updates)
    _close(ours, theirs)
    full = tx.gather_state(state, ours)
    _close(full, ref_state[1])
    _close(tx.shard_state(full, ours), state)


def test_a_checkpoint_of_the_full_state_restores_into_the_unsharded_chain_and_back():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    tx = jaxddp.shard_optimizer(optax.adam(1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jnp.ones((4, 3))
    loss = lambda m: jnp.sum(m(x) ** 2)
    optimizer.update(model, nnx.grad(loss)(model))
    params = nnx.state(model, nnx.Param)
    with tempfile.TemporaryDirectory() as d, jaxddp.CheckpointManager(d) as ckpt:
        ckpt.save(1, {"params": params, "opt": tx.gather_state(optimizer.opt_state, params)})
        target = {"params": params, "opt": optax.adam(1e-2).init(params)}
        restored = ckpt.restore(1, target)
    chain = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))
    grads = nnx.grad(loss)(model)
    ref, _ = chain.update(grads, (optax.EmptyState(), restored["opt"]), params)
    ours, _ = tx.update(grads, tx.shard_state(restored["opt"], params), params)
    _close(ours, ref)
    assert int(restored["opt"][0].count) == 1
    # and back into an nnx.Optimizer
    fresh = nnx.Optimizer(model, tx, wrt=nnx.Param)
    nnx.update(fresh.opt_state, nnx.state(tx.shard_state(restored["opt"], params)))
    _close(nnx.as_pure(fresh.opt_state), nnx.as_pure(optimizer.opt_state))


def test_the_primitives_move_data_at_one_rank_inside_jit():
    comm = _comm.jax_comm()
    x = jnp.arange(6.0, dtype=jnp.float32).reshape(1, 6)
    gathered, moved = jax.jit(
        lambda x: (
            _ops.allgather_many([x[0]], comm)[0],
            _ops.alltoall_many([x], comm)[0],
        )
    )(x)
    assert gathered.shape == (1, 6)
    assert moved.shape == (1, 6)
    np.testing.assert_array_equal(gathered, x)
    np.testing.assert_array_equal(moved, x)
    with pytest.raises(ValueError, match=r"shape \(1, \.\.\.\)"):
        _ops.alltoall_many([jnp.ones((2, 3))], comm)


def test_refusals_name_the_operation_and_the_fix():
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"reduce_sum.*_clipping\.py.*clip_global_norm=\.\.\."):
        jaxddp.shard_optimizer(clipped).init(PARAMS)
    with pytest.raises(ValueError, match="positive number"):
        jaxddp.shard_optimizer(optax.adam(1e-3), clip_global_norm=-1)
    with pytest.raises(TypeError, match="`check`"):
        jaxddp.shard_optimizer(optax.adam(1e-3), check="yes")  # pyright: ignore[reportArgumentType]
    tx = jaxddp.shard_optimizer(optax.adam(1e-3))
    with pytest.raises(TypeError, match=r"bool leaf at `\['flag'\]`"):
        tx.init({"w": jnp.ones(2), "flag": jnp.bool_(True)})


@pytest.mark.parametrize(
    "inner",
    [optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), optax.lamb(1e-3),
     optax.lars(1e-3), optax.adafactor(1e-3), optax.apply_if_finite(optax.adam(1e-3), 3)],
    ids=["clip_by_global_norm", "lamb", "lars", "adafactor", "apply_if_finite"],
)  # fmt: skip
def test_an_inner_optimizer_that_reduces_across_elements_is_refused_at_init(inner):
    with pytest.raises(ValueError, match="clip_global_norm=") as info:
        jaxddp.shard_optimizer(inner).init({"w": jnp.ones(9)})
    assert "slice" in str(info.value)


@pytest.mark.parametrize("compression", ["bf16", jaxddp.PowerSGD(rank=2)], ids=str)
def test_compression_inside_the_sharded_optimizer_is_refused_at_init(compression):
    """It would reduce this rank's slice with the other ranks' slices (other parameters)."""
    inner = optax.chain(jaxddp.allreduce_gradients(compression=compression), optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"has no gradient compression.*optax\.chain\(jaxddp"):
        jaxddp.shard_optimizer(inner).init({"w": jnp.ones((8, 8))})


def test_bad_input_is_refused_with_the_fix():
    for masked in (
        optax.adamw(1e-3, mask={"w": True}),  # a tree of the parameters' structure
        optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda _: True, p)),  # a callable
    ):
        with pytest.raises(ValueError, match=r"optax\.masked"):
            jaxddp.shard_optimizer(masked).init({"w": jnp.ones(3)})
    with pytest.raises(TypeError, match=r"int32 leaf at `\['n'\]`"):
        jaxddp.shard_optimizer(optax.adam(1e-3)).init({"w": jnp.ones(3), "n": jnp.int32(1)})
    tx = jaxddp.shard_optimizer(optax.adam(1e-3))
    with pytest.raises(TypeError, match="shard_state"):
        tx.update({"w": jnp.ones(3)}, optax.adam(1e-3).init({"w": jnp.ones(3)}))
    with pytest.raises(TypeError, match="GradientTransformation"):
        jaxddp.shard_optimizer(optax.adam)  # the factory, not the transform
    with pytest.raises(ValueError, match="clip_global_norm"):
        jaxddp.shard_optimizer(optax.adam(1e-3), clip_global_norm=0.0)
