"""Every rank starts its collectives in the same order: values checked on real ranks.

A step whose collectives started in different orders on different ranks would mix their
messages (wrong values, "Message truncated") or deadlock. Each case here checks every
element of every result against the value computed from all ranks' inputs, and which form
the collectives took: chained (no JAX effect, the fast path) where every collective is at the
jit's own level, ordered (mpi4jax's effect) inside control flow. The ``ordered`` variant
runs the same cases with the ordered form forced everywhere: the fallback path.
"""

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
import optax
import pytest
from mpi4py import MPI

import jaxddp
from jaxddp._collectives._jax import path as _path

MPI_SIZES = (2, 4)
MPI_VARIANTS = {"ordered": {"JAXDDP_TEST_COLLECTIVE_PATH": "ordered"}}

rank = jaxddp.rank()
size = jaxddp.world_size()
ranks = np.arange(size)
FAST = _path.fast_path()


def _forms(fun, *args):
    """The names of jaxddp's staged collectives in the jaxpr of ``fun``, at any depth."""
    names = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name.startswith("jaxddp_"):
                names.append(eqn.primitive.name)
            for value in eqn.params.values():
                for item in value if isinstance(value, tuple | list) else (value,):
                    inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr or a Jaxpr
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(fun.trace(*args).jaxpr.jaxpr)  # traced as the top-level jit it is
    return names


def _per_rank(make):
    """``make(r)`` for every rank r, stacked: what each rank passes."""
    return np.stack([np.asarray(make(r)) for r in range(size)])


def test_collectives_of_different_and_equal_sizes_in_one_step():
    def make(r):
        return {
            "big": np.full(300_001, r + 1.0, np.float32),  # travels alone
            "same_a": np.arange(5.0, dtype=np.float32) * (r + 1),
            "same_b": np.arange(5.0, dtype=np.float32) - r,
            "ints": np.array([r, 2 * r, 3], np.int32),
        }

    @jax.jit
    def step(tree):
        total = jaxddp.allreduce(tree, op="sum")
        top = jaxddp.allreduce(tree["same_a"], op="max")
        low = jaxddp.allreduce(tree["same_b"], op="min")
        root = jaxddp.broadcast(tree["ints"], root=size - 1)
        return total, top, low, root

    mine = jax.tree.map(jnp.asarray, make(rank))
    assert set(_forms(step, mine)) == ({"jaxddp_chained"} if FAST else {"jaxddp_ordered"})
    for _ in range(20):
        total, top, low, root = step(mine)
        everyone = [make(r) for r in range(size)]
        for key in mine:
            np.testing.assert_array_equal(total[key], np.sum([t[key] for t in everyone], 0))
        np.testing.assert_array_equal(top, _per_rank(lambda r: make(r)["same_a"]).max(0))
        np.testing.assert_array_equal(low, _per_rank(lambda r: make(r)["same_b"]).min(0))
        np.testing.assert_array_equal(root, make(size - 1)["ints"])


def test_no_effect_on_the_fast_path():
    step = jax.jit(lambda x: jaxddp.allreduce({"a": x, "b": x * 2}, op="sum"))
    assert (step.trace(jnp.ones(3)).jaxpr.effects == set()) == FAST


def _top_forms(fun, *args):
    """The primitives at the jit's own level of ``fun``'s jaxpr, in order."""
    return [eqn.primitive.name for eqn in fun.trace(*args).jaxpr.jaxpr.eqns]


def test_a_jitted_function_called_on_its_own_then_inside_another_jit():
    step = jax.jit(lambda x: jaxddp.allreduce(x, op="sum"))
    x = jnp.arange(3.0) + rank
    total = _per_rank(lambda r: np.arange(3.0) + r).sum(0)
    np.testing.assert_array_equal(step(x), total)  # traced on its own first: chained
    outer = jax.jit(lambda x: step(x * 2) + jaxddp.allreduce(x, op="max"))
    if FAST:  # replayed into the caller: one chain, no nested call holding another
        forms = _top_forms(outer, x)
        assert "jit" not in forms
        assert forms.count("jaxddp_chained") == 2
        assert forms.count("create_token") == 1
    for _ in range(50):
        np.testing.assert_array_equal(outer(x), 2 * total + np.arange(3.0) + size - 1)
    inline = jax.jit(lambda x: jaxddp.allreduce(x, op="sum"), inline=True)
    np.testing.assert_array_equal(inline(x), total)
    outer = jax.jit(lambda x: inline(x * 2) + jaxddp.allreduce(x, op="max"))
    np.testing.assert_array_equal(outer(x), 2 * total + np.arange(3.0) + size - 1)


def test_a_jitted_function_called_on_its_own_then_inside_scan_and_under_grad():
    # relu is a custom_jvp: the replay binds such equations as JAX's own evaluation does
    step = jax.jit(lambda x: jaxddp.allreduce(jax.nn.relu(x), op="sum"))
    x = jnp.arange(3.0) + rank
    total = _per_rank(lambda r: np.arange(3.0) + r).sum(0)
    np.testing.assert_array_equal(step(x), total)
    scan = jax.jit(lambda xs: jax.lax.scan(lambda c, xi: (c + step(xi), None), x, xs)[0])
    xs = jnp.stack([x, 2 * x, 3 * x])
    if FAST:  # inside the loop body: the ordered form
        assert set(_forms(scan, xs)) == {"jaxddp_ordered"}
    np.testing.assert_array_equal(scan(xs), x + 6 * total)
    grad = jax.jit(lambda x: jax.grad(lambda y: step(y * y).sum())(x) + step(x))
    # d/dx_r of sum over ranks' x_q^2: 2 x_r, with the cotangents summed over the ranks
    np.testing.assert_allclose(grad(x), 2 * x * size + total)


def _switched(x):
    """Chained collectives, then one inside a branch (which ends the chain), then more at the
    top, ordered: the cached jaxpr holds a bridge from its chain into the ordered effect."""
    a = jaxddp.allreduce(x, op="sum")
    b = jax.lax.cond(x[0] > -1, lambda y: jaxddp.allreduce(y, op="max"), lambda y: y, x)
    return a + b + jaxddp.allreduce(x, op="min")


def test_a_function_whose_chain_ends_in_a_branch_called_inside_another_jit_and_scan():
    step = jax.jit(_switched)
    x = jnp.arange(3.0) + rank
    own = _per_rank(lambda r: np.arange(3.0) + r)
    expected = own.sum(0) + own.max(0) + own.min(0)
    np.testing.assert_array_equal(step(x), expected)
    outer = jax.jit(
        lambda x: jaxddp.allreduce(x, op="sum") + step(x) + jaxddp.allreduce(x, op="max")
    )
    if FAST:  # the caller's chain runs into the bridge; what follows it is ordered
        forms = [f for f in _top_forms(outer, x) if f.startswith("jaxddp_") or f == "cond"]
        assert forms == [
            *["jaxddp_chained"] * 2, "jaxddp_bridge", "cond", *["jaxddp_ordered"] * 2
        ]  # fmt: skip
    for _ in range(50):
        np.testing.assert_array_equal(outer(x), own.sum(0) + expected + own.max(0))
    scan = jax.jit(lambda xs: jax.lax.scan(lambda c, xi: (c + step(xi), None), x, xs)[0])
    np.testing.assert_array_equal(scan(jnp.stack([x, x])), x + 2 * expected)


def test_a_jitted_helper_first_called_inside_a_step_then_on_its_own():
    # traced inside the step after a collective, it must not keep the step's chain token
    helper = jax.jit(lambda m: jaxddp.allreduce(m, op="sum"))
    step = jax.jit(lambda x: jaxddp.allreduce(x, op="max") + helper(x))
    x = jnp.arange(3.0) + rank
    own = _per_rank(lambda r: np.arange(3.0) + r)
    np.testing.assert_array_equal(step(x), own.max(0) + own.sum(0))
    np.testing.assert_array_equal(helper(x), own.sum(0))
    again = jax.jit(lambda x: helper(x) * 2 + jaxddp.allreduce(x, op="min"))
    np.testing.assert_array_equal(again(x), 2 * own.sum(0) + own.min(0))


def test_a_cached_step_whose_only_collective_is_in_a_branch_ends_the_callers_chain():
    # traced on its own first, it holds no chained collective and no bridge, only a cond
    # with the ordered effect: inside another jit the caller's chain must end before it
    helper = jax.jit(
        lambda x: jax.lax.cond(x[0] > -1, lambda y: jaxddp.allreduce(y, "sum"), lambda y: y, x)
    )
    x = jnp.arange(3.0) + rank
    own = _per_rank(lambda r: np.arange(3.0) + r)
    np.testing.assert_array_equal(helper(x), own.sum(0))
    outer = jax.jit(
        lambda x: jaxddp.allreduce(x, op="min") + helper(x) + jaxddp.allreduce(x, op="max")
    )
    if FAST:
        forms = [f for f in _top_forms(outer, x) if f.startswith("jaxddp_") or f == "jit"]
        assert forms == ["jaxddp_chained", "jaxddp_bridge", "jit", "jaxddp_ordered"], forms
    for _ in range(20):
        np.testing.assert_array_equal(outer(x), own.min(0) + own.sum(0) + own.max(0))
    first = jax.jit(lambda x: helper(x) + jaxddp.allreduce(x, op="max"))  # no chain before
    if FAST:
        forms = [f for f in _top_forms(first, x) if f.startswith("jaxddp_") or f == "jit"]
        assert forms == ["jit", "jaxddp_ordered"], forms
    np.testing.assert_array_equal(first(x), own.sum(0) + own.max(0))


def test_a_cached_step_under_jvp_and_vmap_inside_another_jit():
    step = jax.jit(lambda x: jaxddp.allreduce(x * x, op="sum"))
    x = jnp.arange(3.0) + rank
    own = _per_rank(lambda r: np.arange(3.0) + r)
    np.testing.assert_array_equal(step(x), (own**2).sum(0))
    jvp = jax.jit(lambda x: (jax.jvp(step, (x,), (jnp.ones(3),))[1], jaxddp.allreduce(x, "max")))
    if FAST:  # forward mode at the caller's own level: the tangent joins the chain
        assert set(_forms(jvp, x)) == {"jaxddp_chained"}
    tangent, top = jvp(x)
    np.testing.assert_array_equal(tangent, (2 * own).sum(0))
    np.testing.assert_array_equal(top, own.max(0))
    batched = jax.jit(lambda xs: jax.vmap(step)(xs) + jaxddp.allreduce(xs, op="sum"))
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_array_equal(
        batched(xs),
        np.stack([(own**2).sum(0), (4 * own**2).sum(0)]) + np.stack([1, 2])[:, None] * own.sum(0),
    )


def _model():
    params = {"w": jnp.full((4, 3), 0.5), "b": jnp.zeros(3)}
    x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4) / 10 + rank
    y = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3) / 7 - rank
    return params, x, y


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def test_a_metric_allreduce_and_the_gradient_sync_in_one_step():
    params, x, y = _model()
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.sgd(0.1))

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        metric = jaxddp.allreduce({"loss": loss, "count": jnp.int32(1)}, op="sum")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metric

    assert set(_forms(step, params, tx.init(params), x, y)) == (
        {"jaxddp_chained"} if FAST else {"jaxddp_ordered"}
    )
    new, _, metric = step(params, tx.init(params), x, y)
    losses, grads = zip(
        *[jax.value_and_grad(_loss)(params, x - rank + r, y + rank - r) for r in range(size)],
        strict=True,
    )
    np.testing.assert_allclose(metric["loss"], np.sum(losses), rtol=1e-6)
    assert int(metric["count"]) == size
    mean_grad = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *grads)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, mean_grad)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_multisteps_collective_inside_cond_with_a_metric_allreduce_outside():
    params, x, y = _model()
    k = 2
    tx = optax.MultiSteps(optax.chain(jaxddp.allreduce_gradients(), optax.sgd(0.1)), k)

    @jax.jit
    def step(params, opt_state, x, y):
        before = jaxddp.allreduce(jnp.float32(rank), op="sum")
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        after = jaxddp.allreduce(loss, op="max")
        return optax.apply_updates(params, updates), opt_state, before, after

    forms = _forms(step, params, tx.init(params), x, y)
    assert "jaxddp_ordered" in forms
    if FAST:
        assert forms[0] == "jaxddp_chained"  # before the cond: still on the chain
    state, current = tx.init(params), params
    for i in range(4):
        losses = [float(_loss(current, x - rank + r, y + rank - r)) for r in range(size)]
        current, state, before, after = step(current, state, x, y)
        assert float(before) == ranks.sum()
        np.testing.assert_allclose(after, max(losses), rtol=1e-6)
        if i % k == k - 1:  # an update was applied: identical everywhere
            hi = jaxddp.allreduce(current, op="max")
            lo = jaxddp.allreduce(current, op="min")
            for a, b in zip(jax.tree.leaves(hi), jax.tree.leaves(lo), strict=True):
                np.testing.assert_array_equal(a, b)


def test_shard_optimizer_at_the_top_and_inside_multisteps_cond_beside_metric_allreduces():
    # its alltoall and allgather: chained at the jit's own level, ordered inside the cond
    # (after a bridge from the chain), every value equal to the unsharded chain's
    params, x, y = _model()
    k = 2
    runs = {}
    for name, sync in (
        ("sharded", jaxddp.shard_optimizer(optax.adam(0.1))),
        ("unsharded", optax.chain(jaxddp.allreduce_gradients(), optax.adam(0.1))),
    ):
        for multi in (False, True):
            tx = optax.MultiSteps(sync, k) if multi else sync

            @jax.jit
            def step(params, opt_state, x, y, tx=tx):
                before = jaxddp.allreduce(jnp.float32(rank), op="sum")
                loss, grads = jax.value_and_grad(_loss)(params, x, y)
                updates, opt_state = tx.update(grads, opt_state, params)
                after = jaxddp.allreduce(loss, op="max")
                return optax.apply_updates(params, updates), opt_state, before + after

            forms = _forms(step, params, tx.init(params), x, y)
            if not FAST:
                assert set(forms) == {"jaxddp_ordered"}
            elif multi:
                assert forms[0] == "jaxddp_chained"
                assert "jaxddp_ordered" in forms
            else:
                assert set(forms) == {"jaxddp_chained"}
            state, current, metrics = tx.init(params), params, []
            for _ in range(4):
                current, state, metric = step(current, state, x, y)
                metrics.append(float(metric))
            runs[name, multi] = current, metrics
    for multi in (False, True):
        (ours, ours_metrics), (ref, ref_metrics) = runs["sharded", multi], runs["unsharded", multi]
        np.testing.assert_allclose(ours_metrics, ref_metrics, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_jitted_sharded_update_called_on_its_own_then_inside_another_jit():
    params, x, y = _model()
    grads = jax.grad(_loss)(params, x, y)
    tx = jaxddp.shard_optimizer(optax.sgd(0.1))
    update = jax.jit(tx.update)
    alone, _ = update(grads, tx.init(params), params)  # traced for its own top level first

    @jax.jit
    def outer(grads, state, params):
        before = jaxddp.allreduce(jnp.float32(rank), op="sum")
        updates, state = update(grads, state, params)  # replayed into outer's chain
        return updates, before + jaxddp.allreduce(jnp.float32(rank), op="max")

    if FAST:
        assert set(_forms(outer, grads, tx.init(params), params)) == {"jaxddp_chained"}
    inside, metric = outer(grads, tx.init(params), params)
    assert float(metric) == ranks.sum() + size - 1
    mean = jaxddp.allreduce(grads)
    for a, b, g in zip(
        jax.tree.leaves(alone), jax.tree.leaves(inside), jax.tree.leaves(mean), strict=True
    ):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, -0.1 * g, rtol=1e-6)


def test_collectives_inside_scan_and_fori_loop():
    def body(i, carry):
        x, acc = carry
        x = jaxddp.allreduce(x, op="sum") / size + 1.0
        acc = acc + jaxddp.allreduce(jnp.float32(rank * i), op="sum")
        return x, acc

    @jax.jit
    def step(x):
        start = jaxddp.allreduce(x, op="max")
        x, acc = jax.lax.fori_loop(0, 5, body, (x, jnp.float32(0)))
        ys = jax.lax.scan(lambda c, v: (c, jaxddp.allreduce(v * c, op="sum")), 2.0, x[:3])[1]
        end = jaxddp.allreduce(x, op="min")
        return start, x, acc, ys, end

    mine = jnp.arange(6.0) + rank
    assert "jaxddp_ordered" in _forms(step, mine)
    start, x, acc, ys, end = step(mine)
    np.testing.assert_array_equal(start, np.arange(6.0) + size - 1)
    expected = np.arange(6.0) + ranks.mean()
    for _ in range(5):
        expected = expected + 1.0
    np.testing.assert_allclose(x, expected, rtol=1e-6)
    assert float(acc) == sum(ranks.sum() * i for i in range(5))
    np.testing.assert_allclose(ys, 2.0 * size * expected[:3], rtol=1e-6)
    np.testing.assert_allclose(end, expected, rtol=1e-6)


def test_two_jitted_functions_dispatched_back_to_back_without_waiting():
    f = jax.jit(lambda x: jaxddp.allreduce(x * (rank + 1), op="sum"))
    g = jax.jit(lambda x: jaxddp.allreduce(x + rank, op="max"))
    x = jnp.arange(1000.0)
    results = []
    for _ in range(1000):
        results.append((f(x), g(x)))  # no data dependence, no wait in between
    weights = (ranks + 1).sum()
    wrong = sum(
        not (np.array_equal(a, np.arange(1000.0) * weights) and np.array_equal(b, x + size - 1))
        for a, b in results
    )
    assert wrong == 0


def test_the_users_own_mpi4jax_allreduce_on_their_communicator_in_the_same_step():
    theirs = MPI.COMM_WORLD.Clone()
    params, x, y = _model()
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.sgd(0.1))

    @jax.jit
    def step(params, opt_state, x, y):
        own = mpi4jax.allreduce(jnp.float32(rank + 1), op=MPI.SUM, comm=theirs)
        grads = jax.grad(_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        also = mpi4jax.allreduce(x.sum(), op=MPI.MAX, comm=theirs)
        return optax.apply_updates(params, updates), own, also

    sums = [float(x.sum() - 32 * rank + 32 * r) for r in range(size)]
    grads = [jax.grad(_loss)(params, x - rank + r, y + rank - r) for r in range(size)]
    mean_grad = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *grads)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, mean_grad)
    for _ in range(300):
        new, own, also = step(params, tx.init(params), x, y)
        assert float(own) == (ranks + 1).sum()
        np.testing.assert_allclose(also, max(sums), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    theirs.Free()


@pytest.mark.parametrize("n", [10**5, 10**6, 10**7])
def test_large_buffers_reduced_repeatedly_in_a_loop_every_element_checked(n):
    # https://github.com/mpi4jax/mpi4jax/issues/229 saw only the head of such a buffer come out
    # right.
    @jax.jit
    def step(x):
        return jax.lax.fori_loop(0, 3, lambda i, v: jaxddp.allreduce(v, op="sum") - v, x)

    x = jnp.arange(n, dtype=jnp.float32) % 1000 + rank
    # v -> sum_r v_r - v, whose sum over the ranks grows (size - 1)-fold a round: 3 rounds,
    # exact in float64 for these small integers (this rank's values only: the stack of all
    # ranks' took 2.7 s per rank at 4 ranks and 10**7)
    base = np.arange(n, dtype=np.float64) % 1000
    v, total = base + rank, size * base + size * (size - 1) / 2
    for _ in range(3):
        v, total = total - v, (size - 1) * total
    np.testing.assert_array_equal(np.asarray(step(x)), v.astype(np.float32))


def test_a_staged_step_under_grad_jvp_and_vmap():
    # a jitted function called under a transformation is differentiated or batched in the
    # form it was staged in
    f = jax.jit(lambda x: jaxddp.allreduce(x * x, op="sum").sum())
    x = jnp.arange(3.0) + rank
    assert float(f(x)) == sum(float(((np.arange(3.0) + r) ** 2).sum()) for r in range(size))
    # psum's definition: every rank's loss is the same sum, so the cotangent is summed
    np.testing.assert_array_equal(jax.grad(f)(x), 2 * x * size)
    _, tangent = jax.jvp(f, (x,), (jnp.ones(3),))
    assert float(tangent) == sum(float(2 * (np.arange(3.0) + r).sum()) for r in range(size))
    g = jax.jit(lambda v: jaxddp.allreduce(v, op="sum"))
    batched = jax.vmap(g)(jnp.stack([x, 2 * x]))
    total = sum(np.arange(3.0) + r for r in range(size))
    np.testing.assert_array_equal(batched, np.stack([total, 2 * total]))


def test_a_staged_step_with_a_collective_in_a_cond_after_one_at_the_top_under_grad_and_vmap():
    # the collective in the cond ends the chain: a bridge at the top carries the chain's
    # token into the ordered effect, and differentiating or batching the staged step (the
    # chained form, the bridge, the ordered form) must keep all three working
    def g(x, y):
        a = jaxddp.allreduce(x * x, op="sum")
        b = jax.lax.cond(y > 0, lambda v: jaxddp.allreduce(3.0 * v, op="sum"), lambda v: 0.0 * v, x)
        return jnp.sum(a) + jnp.sum(b)

    x, y = jnp.arange(3.0) + rank, jnp.float32(1.0)
    staged = jax.jit(g)
    per_rank = np.stack([np.arange(3.0) + r for r in range(size)])
    assert float(staged(x, y)) == float((per_rank**2).sum() + 3 * per_rank.sum())
    expected = size * (2 * np.asarray(x) + 3)  # psum's rule: W times this rank's share
    np.testing.assert_allclose(jax.grad(staged)(x, y), expected, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(g))(x, y), expected, rtol=1e-6)
    f = jax.jit(
        lambda v, y: (
            jaxddp.allreduce(v, op="sum")
            + jax.lax.cond(y > 0, lambda u: jaxddp.allreduce(u, op="sum"), lambda u: u, v)
        )
    )
    f(x, y)  # staged at the top level first, then batched
    batched = jax.vmap(f, in_axes=(0, None))(jnp.stack([x, 2 * x]), y)
    total = per_rank.sum(0)
    np.testing.assert_allclose(batched, np.stack([2 * total, 4 * total]), rtol=1e-6)


def test_forward_and_reverse_mode_through_collectives_inside_one_step():
    def f(x):
        return jaxddp.allreduce(x * x, op="sum")

    @jax.jit
    def forward(x, t):
        a = jaxddp.allreduce(x, op="max")
        y, ty = jax.jvp(f, (x,), (t,))  # the tangent's collective runs, in the chain
        return a, y, ty, jaxddp.allreduce(y + ty, op="min")

    @jax.jit
    def reverse(x):
        grad = jax.grad(lambda v: jaxddp.masked_mean(v * v, jnp.ones(3, bool)))(x)
        return jaxddp.allreduce(grad, op="sum")

    x = jnp.arange(3.0) + rank
    per_rank = np.stack([np.arange(3.0) + r for r in range(size)])
    assert set(_forms(forward, x, jnp.ones(3))) == {"jaxddp_chained" if FAST else "jaxddp_ordered"}
    assert set(_forms(reverse, x)) == {"jaxddp_chained" if FAST else "jaxddp_ordered"}
    a, y, ty, b = forward(x, jnp.ones(3))
    np.testing.assert_array_equal(a, per_rank.max(0))
    np.testing.assert_array_equal(y, (per_rank**2).sum(0))
    np.testing.assert_array_equal(ty, (2 * per_rank).sum(0))
    np.testing.assert_array_equal(b, y + ty)
    # psum's definition: each rank's gradient is its share times the world size (every
    # rank's loss is the same mean), so the sum over ranks is size times the whole gradient
    np.testing.assert_allclose(reverse(x), (2 * per_rank / 3).sum(0), rtol=1e-6)
