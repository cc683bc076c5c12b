"""Gradients on real ranks: unused parameters, DDP equivalence, MultiSteps, checks, sync."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


def _identical_on_every_rank(tree):
    """True when every leaf has the same value on all ranks."""
    hi = jaxddp.allreduce(tree, op="max")
    lo = jaxddp.allreduce(tree, op="min")
    return all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(hi), jax.tree.leaves(lo), strict=True)
    )


def _init(seed, n_experts):
    keys = jax.random.split(jax.random.key(seed), n_experts + 1)
    return {
        "shared": jax.random.normal(keys[0], (4, 4)),
        "experts": {f"e{i}": jax.random.normal(keys[i + 1], (4, 2)) for i in range(n_experts)},
    }


def test_conditional_model_trains_without_hanging_and_stays_identical():
    """Each rank runs only its own expert, so each rank lacks different gradients."""
    n_experts = size + 1  # one expert no rank ever uses
    params = jaxddp.synchronize(_init(seed=rank, n_experts=n_experts))  # differing seeds
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))
    opt_state = tx.init(params)
    x = jnp.ones((8, 4)) * (rank + 1)
    mine = f"e{rank}"

    def loss(used, x):
        h = jnp.tanh(x @ used["shared"])
        return jnp.mean((h @ used["experts"][mine]) ** 2)

    @jax.jit
    def step(params, opt_state, x):
        # a partial tree: gradients only for what this rank used
        used = {"shared": params["shared"], "experts": {mine: params["experts"][mine]}}
        grads = jax.grad(loss)(used, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    before = params
    for _ in range(5):
        params, opt_state = step(params, opt_state, x)
    assert _identical_on_every_rank(params)
    assert _identical_on_every_rank(opt_state)
    # every used expert moved; the unused one did not
    for i in range(size):
        assert not np.allclose(params["experts"][f"e{i}"], before["experts"][f"e{i}"])
    np.testing.assert_array_equal(params["experts"][f"e{size}"], before["experts"][f"e{size}"])


def _mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _mlp_data():
    k1, k2, k3 = jax.random.split(jax.random.key(42), 3)
    params = {
        "w1": jax.random.normal(k1, (5, 8)) * 0.5,
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(k2, (8, 1)) * 0.5,
    }
    x = jax.random.normal(k3, (8 * size, 5))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    return params, x, y


def _train(tx, params, batches, loss=_mlp_loss):
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for x, y in batches:
        params, opt_state = step(params, opt_state, x, y)
    return params


def _shard(a):
    per = a.shape[0] // size
    return a[rank * per : (rank + 1) * per]


def test_ddp_equals_one_process_on_the_whole_batch():
    params, x, y = _mlp_data()
    steps = 5
    ddp = _train(
        optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2)),
        params,
        [(_shard(x), _shard(y))] * steps,
    )
    single = _train(optax.adam(1e-2), params, [(x, y)] * steps)
    for a, b in zip(jax.tree.leaves(ddp), jax.tree.leaves(single), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ddp["w1"], params["w1"])


def test_a_flat_state_trains_like_the_tree_it_was_raveled_from():
    """The docs' recipe for many-leaf models: ravel the parameters into one vector."""
    from jax.flatten_util import ravel_pytree

    params, x, y = _mlp_data()
    batches = [(_shard(x), _shard(y))] * 5
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))
    tree = _train(tx, params, batches)
    vector, unravel = ravel_pytree(params)
    flat = unravel(_train(tx, vector, batches, loss=lambda v, x, y: _mlp_loss(unravel(v), x, y)))
    for a, b in zip(jax.tree.leaves(flat), jax.tree.leaves(tree), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert _identical_on_every_rank(flat)
    assert not np.allclose(flat["w1"], params["w1"])


def test_multisteps_equals_one_process():
    params, x, y = _mlp_data()
    k = 3
    micro = [(x * (i + 1), y) for i in range(2 * k)]
    ddp = _train(
        optax.MultiSteps(optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2)), k),
        params,
        [(_shard(a), _shard(b)) for a, b in micro],
    )
    single = _train(optax.MultiSteps(optax.adam(1e-2), k), params, micro)
    for a, b in zip(jax.tree.leaves(ddp), jax.tree.leaves(single), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_multisteps_communicates_only_when_it_applies_an_update():
    params, _, _ = _mlp_data()
    tx = optax.MultiSteps(optax.chain(jaxddp.allreduce_gradients(), optax.sgd(0.1)), 4)
    jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr
    top = [e.primitive.name for e in jaxpr.eqns]
    assert not any(name.startswith("jaxddp_") for name in top), top
    inside = [
        e.primitive.name
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "cond"
        for branch in eqn.params["branches"]
        for e in branch.jaxpr.eqns
    ]
    assert "jaxddp_ordered" in inside  # inside control flow: mpi4jax's ordered effect


def test_mismatched_trees_with_check_raise_on_every_rank():
    params = {"w": jnp.ones(3)}
    if rank == 1:
        params["extra"] = jnp.ones(2)
    tx = jaxddp.allreduce_gradients(check=True)
    grads = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(jaxddp.TreeMismatchError, match=r"\['extra'\].*rank 1 has float32\[2\]"):
        jax.jit(tx.update)(grads, tx.init(params), params)


def test_check_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAXDDP_CHECK", "1")
    tx = jaxddp.allreduce_gradients()
    grads = {"w": jnp.ones(3 if rank == 0 else 4)}
    with pytest.raises(jaxddp.TreeMismatchError, match=r"rank 0 has float32\[3\]"):
        tx.update(grads, tx.init(None))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize(
    ("mine", "pattern"),
    [
        (
            jnp.ones(3, jnp.float32 if rank == 0 else jnp.int32),
            r"rank 0 has float32\[3\], rank 1 has int32\[3\]",
        ),
        (jnp.ones((2, 3) if rank == 0 else (3, 2)), r"rank 0 has float32\[2,3\], rank 1 has"),
    ],
    ids=["dtype", "shape"],
)
def test_mismatched_gradients_raise_by_default_instead_of_reducing_garbage(
    monkeypatch, mine, pattern, jit
):
    """Same sizes, so MPI would happily add the bytes together: the default check refuses."""
    monkeypatch.delenv("JAXDDP_CHECK", raising=False)
    tx = jaxddp.allreduce_gradients()
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(jaxddp.TreeMismatchError, match=r"\['w'\]`: " + pattern):
        update({"w": mine}, tx.init(None))


@pytest.mark.parametrize(("variable", "calls"), [(None, 1), ("0", 0), ("off", 0)])
def test_the_default_check_runs_once_per_compilation_not_per_step(monkeypatch, variable, calls):
    from jaxddp._collectives import signature as _signature

    if variable is None:
        monkeypatch.delenv("JAXDDP_CHECK", raising=False)
    else:
        monkeypatch.setenv("JAXDDP_CHECK", variable)
    seen = []
    exchange = _signature._exchange
    monkeypatch.setattr(_signature, "_exchange", lambda *a: (seen.append(1), exchange(*a))[1])
    params, _, _ = _mlp_data()
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.sgd(0.1))
    state = tx.init(params)
    step = jax.jit(tx.update)
    grads = jax.tree.map(lambda p: jnp.full_like(p, rank + 1.0), params)
    for _ in range(20):
        updates, state = step(grads, state, params)
    assert len(seen) == calls
    mean = np.mean(np.arange(1, size + 1))
    for leaf in jax.tree.leaves(updates):
        np.testing.assert_allclose(leaf, -0.1 * mean, rtol=1e-6)


def test_synchronize_gives_every_rank_roots_params_and_adam_state():
    root = size - 1
    params = _init(seed=rank, n_experts=2)
    opt_state = optax.adam(1e-3).init(params)
    opt_state = jax.tree.map(lambda x: x + rank, opt_state)  # counters differ too
    tree = (params, opt_state, "tag", 7.0 + rank)
    params2, state2, tag, number = jaxddp.synchronize(tree, root=root)
    expected = _init(seed=root, n_experts=2)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(state2[0].count) == root
    assert tag == "tag"
    assert number == 7.0 + root
    assert isinstance(number, float)


def test_synchronize_refuses_mismatched_trees_on_every_rank():
    tree = {"w": jnp.ones((2, 2) if rank == 0 else (2, 3))}
    with pytest.raises(jaxddp.TreeMismatchError, match=r"\['w'\]`: rank 0 has float32\[2,2\]"):
        jaxddp.synchronize(tree)


def test_broadcast_under_jit():
    out = jax.jit(lambda t: jaxddp.broadcast(t, root=1))({"x": jnp.full(3, float(rank))})
    np.testing.assert_array_equal(out["x"], 1.0)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_reduce_onto_root(op):
    out = jaxddp.reduce({"x": jnp.float32(rank + 1), "s": "kept"}, op, root=0)
    values = np.arange(1, size + 1, dtype=np.float32)
    expected = {"sum": values.sum(), "mean": values.mean(), "max": values.max()}[op]
    if rank == 0:
        assert float(out["x"]) == pytest.approx(expected)
    else:
        assert float(out["x"]) == rank + 1
    assert out["s"] == "kept"


def test_bad_root_is_refused():
    with pytest.raises(ValueError, match=r"`root`.*\[0, "):
        jaxddp.broadcast({"x": jnp.ones(1)}, root=size)


def test_mixed_dtypes_and_many_small_leaves_are_reduced_exactly():
    tree = {
        "f32": [jnp.full((i % 7 + 1,), rank + 1.0) for i in range(300)],
        "bf16": jnp.full((33,), rank + 1, jnp.bfloat16),
        "i32": jnp.arange(5, dtype=jnp.int32) * (rank + 1),
        "big": jnp.full((300_000,), float(rank)),
        "empty": jnp.zeros((0, 3)),
    }
    out = jax.jit(lambda t: jaxddp.allreduce(t, op="sum"))(tree)
    total = size * (size + 1) / 2
    for leaf in out["f32"]:
        np.testing.assert_array_equal(leaf, total)
    assert out["bf16"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(out["bf16"].astype(jnp.float32), total)
    np.testing.assert_array_equal(out["i32"], np.arange(5) * total)
    np.testing.assert_array_equal(out["big"], size * (size - 1) / 2)
    assert out["empty"].shape == (0, 3)


def test_a_resnet50_shaped_tree_of_many_calls_reduces_exactly():
    """161 leaves, 102 MB: dozens of MPI calls in one jitted function, which must run in the
    same order on every rank (a mix-up would hang or add the wrong buffers together)."""
    from benchmarks.payloads import resnet50_shapes

    shapes = resnet50_shapes(1.0)
    tree = {f"p{i:03d}": jnp.full(s, (i + 1.0) * (rank + 1)) for i, s in enumerate(shapes)}
    f = jax.jit(lambda t: jaxddp.allreduce(t, op="sum"))
    for _ in range(2):
        out = f(tree)
        for i in range(len(shapes)):
            np.testing.assert_array_equal(out[f"p{i:03d}"], (i + 1) * size * (size + 1) / 2)
