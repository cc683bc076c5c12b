"""``allreduce_gradients(compression=...)`` on real ranks: what travels, the error feedback,
the state through MultiSteps and checkpoints, and training that follows the uncompressed run.

Once more with ``JAXDDP_COLLECTIVES=xla``, where the steps that ``jaxddp.spmd`` wraps run
with JAX's collectives and must equal the MPI path's (plain ``jax.jit``)."""

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import jaxddp
from jaxddp._collectives.signature import TreeMismatchError

MPI_SIZES = (2, 4)
MPI_VARIANTS = {"xla": {"JAXDDP_COLLECTIVES": "xla"}}
MPI_VARIANT_SIZES = {"xla": (2,)}  # the 4-rank runs: the MPI path (same arithmetic)

rank = jaxddp.rank()
size = jaxddp.world_size()
WORLD = MPI.COMM_WORLD
XLA = os.environ.get("JAXDDP_COLLECTIVES") == "xla"
COMPRESSIONS = ["bf16", "fp16", jaxddp.PowerSGD(rank=1), jaxddp.PowerSGD(rank=4)]
NOISE = 0.1
NARROW = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def _name(c):
    return c if isinstance(c, str) else f"powersgd{c.rank}"


def _grads(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal((32, 24)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(24), jnp.float32),
        "half": jnp.asarray(rng.standard_normal(5), jnp.bfloat16),
        "count": jnp.int32(seed),
    }


def _everyone(tree):
    """Every rank's tree, as NumPy float64 stacked on a first axis."""
    return jax.tree.map(lambda x: np.asarray(x, np.float64), jaxddp.all_gather(tree))


def _residual(state):
    return np.asarray(state.residual.inner[0])


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"compression": "int8"}, ValueError),
        ({"compression": 16}, TypeError),
        ({"compression": "bf16", "op": "max"}, ValueError),
        ({"compression": "bf16", "error_feedback": 1}, TypeError),
    ],
)
def test_bad_arguments_raise_on_every_rank(kwargs, error):
    with pytest.raises(error, match="Expected"):
        jaxddp.allreduce_gradients(**kwargs)


@pytest.mark.parametrize("rank_", [0, -1, 2.0, True])
def test_powersgd_refuses_a_rank_that_is_not_positive(rank_):
    with pytest.raises((ValueError, TypeError), match="Expected `rank` of PowerSGD"):
        jaxddp.PowerSGD(rank=rank_)


@pytest.mark.parametrize("narrow", ["bf16", "fp16"])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_cast_sums_the_narrow_values_in_float32_and_feeds_back_both_roundings(narrow, op):
    grads = _grads(rank)
    tx = jaxddp.allreduce_gradients(compression=narrow, op=op)
    state = tx.init(grads)
    out, state = jax.jit(tx.update)(grads, state)
    everyone = jaxddp.all_gather(grads)
    dtype = NARROW[narrow]
    # each rank's cast, summed in float32 in rank order, divided, rounded once
    sent = np.asarray(everyone["w"]).astype(dtype).astype(np.float32)
    total = sent[0]
    for j in range(1, size):
        total = total + sent[j]
    if op == "mean":
        total = total / np.float32(size)
    np.testing.assert_array_equal(np.asarray(out["w"]), total.astype(dtype).astype(np.float32))
    # integers exact; the result is the same on every rank
    expect = sum(range(size)) / (size if op == "mean" else 1)
    assert float(out["count"]) == expect
    got = _everyone(out)
    for key in got:
        np.testing.assert_array_equal(got[key][0], got[key][-1])
    # nothing lost: the result plus the ranks' residuals is the exact reduction
    res = _everyone({"r": _residual(state)})["r"]
    exact = np.concatenate([_everyone(grads)[k].reshape(size, -1) for k in ("b", "half", "w")], 1)
    scale = size if op == "mean" else 1
    flat = np.concatenate([np.asarray(out[k], np.float64).ravel() for k in ("b", "half", "w")])
    np.testing.assert_allclose(flat + res.sum(0) / scale, exact.sum(0) / scale, atol=1e-5)


@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_sends_what_the_cast_rounds_away(feedback):
    """1 + 2**-10 is 1.0 in bfloat16: without feedback every step says 1.0 (a bias that
    never goes away); with it the steps average to the true value."""
    grads = {"w": jnp.full((8,), 1 + 2**-10, jnp.float32)}
    tx = jaxddp.allreduce_gradients(compression="bf16", error_feedback=feedback)
    state = tx.init(grads)
    update = jax.jit(tx.update)
    outs = []
    for _ in range(64):
        out, state = update(grads, state)
        outs.append(np.asarray(out["w"]))
    mean = np.mean(outs)
    if feedback:
        assert abs(mean - (1 + 2**-10)) < 2**-14
    else:
        assert mean == 1.0


def test_fp16_saturates_a_large_gradient_and_passes_infinities_through():
    big = 1e6 if rank == 0 else 1.0
    grads = {"w": jnp.asarray([big, 1.0, jnp.inf if rank == size - 1 else 1.0], jnp.float32)}
    tx = jaxddp.allreduce_gradients(compression="fp16", op="sum")
    state = tx.init(grads)
    out, state = jax.jit(tx.update)(grads, state)
    w = np.asarray(out["w"])
    assert w[0] == np.float16(65504)  # summed in float32, saturated
    assert w[1] == size
    assert np.isposinf(w[2])  # an infinity on any rank is the result on every rank
    residual = _everyone({"r": _residual(state)})["r"]
    np.testing.assert_allclose(residual[:, 0].sum(), 1e6 + (size - 1) - 65504, rtol=1e-3)
    assert np.all(residual[:, 2] == 0)  # no infinite debt carried over


def test_powersgd_recovers_a_low_rank_mean_in_one_step():
    rng = np.random.default_rng(0)
    u, v = rng.standard_normal((32, 1)), rng.standard_normal((1, 24))
    grads = {"w": jnp.asarray((rank + 1) * u @ v, jnp.float32), "b": jnp.full(24, float(rank))}
    tx = jaxddp.allreduce_gradients(compression=jaxddp.PowerSGD(rank=2))
    state = tx.init(grads)
    out, state = jax.jit(tx.update)(grads, state)
    np.testing.assert_allclose(out["w"], (size + 1) / 2 * u @ v, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out["b"], np.full(24, (size - 1) / 2, np.float32))  # exact


def test_powersgd_keeps_what_it_misses_and_starts_at_start_step():
    grads = _grads(rank)
    psgd = jaxddp.PowerSGD(rank=1, start_step=1)
    tx = jaxddp.allreduce_gradients(compression=psgd)
    state = tx.init(grads)
    update = jax.jit(tx.update)
    first, state = update(grads, state)  # exact, at full width
    mean = jaxddp.allreduce(grads)
    np.testing.assert_allclose(first["w"], mean["w"], rtol=1e-6, atol=1e-7)  # sum orders
    assert not np.any(_residual(state))
    out, state = update(grads, state)  # compressed: result + mean residual = mean gradient
    res = _everyone({"r": _residual(state)})["r"].mean(0)
    np.testing.assert_allclose(
        np.asarray(out["w"]).ravel() + res, np.asarray(mean["w"]).ravel(), atol=1e-5
    )
    assert np.linalg.matrix_rank(np.asarray(out["w"]), tol=1e-4) == 1
    # a vector travels at full width (MPI may order its sum otherwise in a larger buffer)
    np.testing.assert_allclose(out["b"], mean["b"], rtol=1e-6, atol=1e-7)
    q = _everyone({"q": state.q[0]})["q"]
    np.testing.assert_array_equal(q[0], q[-1])  # the warm start is the same everywhere


def test_ranks_that_disagree_on_compression_raise_on_every_rank():
    grads = _grads(0)
    compression = "bf16" if rank == 0 else None
    tx = jaxddp.allreduce_gradients(compression=compression)
    with pytest.raises(TreeMismatchError, match="compression"):
        jax.jit(tx.update)(grads, tx.init(grads))


@pytest.mark.parametrize("compression", COMPRESSIONS, ids=_name)
def test_spmd_equals_the_mpi_path(compression):
    """Under the xla variant, jaxddp.spmd runs JAX's collectives; jax.jit keeps MPI's."""
    grads = _grads(rank)
    tx = jaxddp.allreduce_gradients(compression=compression)
    state0 = tx.init(grads)
    a, sa = jaxddp.spmd(tx.update)(grads, state0)
    a, sa = jaxddp.spmd(tx.update)(grads, sa)
    b, sb = jax.jit(tx.update)(grads, state0)
    b, sb = jax.jit(tx.update)(grads, sb)
    for key in ("w", "b", "half"):
        np.testing.assert_allclose(
            np.asarray(a[key], np.float32), np.asarray(b[key], np.float32), rtol=1e-5, atol=1e-5
        )
    np.testing.assert_allclose(_residual(sa), _residual(sb), atol=1e-5)


def test_multisteps_accumulates_then_sends_once():
    grads = _grads(rank)
    tx = optax.MultiSteps(
        optax.chain(jaxddp.allreduce_gradients(compression="bf16"), optax.sgd(1.0)), 2
    )
    state = tx.init(grads)
    update = jax.jit(tx.update)
    out, state = update(grads, state)
    assert not np.any(np.asarray(out["w"]))
    out, state = update(grads, state)
    mean = jaxddp.allreduce(grads)
    np.testing.assert_allclose(-np.asarray(out["w"]), mean["w"], rtol=1e-2, atol=1e-2)
    assert int(state.inner_opt_state[0].count) == 1


@pytest.mark.skipif(XLA, reason="Orbax saves no host-local array in a multi-process JAX job")
def test_checkpoint_restores_each_ranks_own_residual():
    grads = _grads(rank)
    tx = optax.chain(jaxddp.allreduce_gradients(compression="bf16"), optax.sgd(0.1))
    state = tx.init(grads)
    _, state = jax.jit(tx.update)(grads, state)
    path = WORLD.bcast(tempfile.mkdtemp(prefix="jaxddp-compress-") if rank == 0 else None)
    manager = jaxddp.CheckpointManager(os.path.join(path, "c"), background=False)
    manager.save(1, {"opt": state})
    restored = manager.restore(1, target={"opt": tx.init(grads)})["opt"]
    manager.close()
    WORLD.Barrier()
    mine = _residual(state[0])
    assert np.any(mine)
    np.testing.assert_array_equal(_residual(restored[0]), mine)


# -- training: each compression follows the uncompressed run ---------------------------------


def _residual_mlp(key, width=32, blocks=2):
    keys = jax.random.split(key, blocks + 2)
    params = {
        f"block{i}": {"w": jax.random.normal(k, (width, width)) / width**0.5, "b": jnp.zeros(width)}
        for i, k in enumerate(keys[:blocks])
    }
    params["in"] = {"w": jax.random.normal(keys[-2], (16, width)) / 4, "b": jnp.zeros(width)}
    params["out"] = {"w": jax.random.normal(keys[-1], (width, 4)) * 0.1, "b": jnp.zeros(4)}
    return params


def _loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(_logits(params, x), y).mean()


def _logits(params, x):
    h = jnp.tanh(x @ params["in"]["w"] + params["in"]["b"])
    for i in range(sum(k.startswith("block") for k in params)):
        h = h + jax.nn.relu(h @ params[f"block{i}"]["w"] + params[f"block{i}"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def _data(n=4096, seed=7):
    """A teacher's classes, a little noisy: more samples than the steps see, so the loss is
    the model's, not what it memorized."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    teacher = np.random.default_rng(0).standard_normal((16, 4))
    y = np.argmax(np.tanh(x @ teacher) + NOISE * rng.standard_normal((n, 4)), 1)
    return x, y


def _train(compression, feedback=True, steps=200):
    x, y = _data()
    params = _residual_mlp(jax.random.key(0))
    tx = optax.chain(
        jaxddp.allreduce_gradients(compression=compression, error_feedback=feedback),
        optax.adam(1e-2),
    )
    state = tx.init(params)
    per = 64 // size

    @jaxddp.spmd
    def step(params, state, xb, yb):
        grads = jax.grad(_loss)(params, xb, yb)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for t in range(steps):
        at = (t * 64) % len(x) + rank * per
        params, state = step(params, state, x[at : at + per], y[at : at + per])
    xt, yt = _data(4096, seed=8)
    logits = jax.jit(_logits)(params, xt)
    return float(jax.jit(_loss)(params, x, y)), float(np.mean(np.argmax(logits, 1) == yt))


@pytest.mark.skipif(
    XLA,
    reason="trained on the MPI path; the xla path's steps equal its steps "
    "(test_spmd_equals_the_mpi_path), and 5 trainings over gloo cost ~30 s of the suite",
)
def test_training_with_each_compression_ends_at_the_uncompressed_loss():
    """Same data, same 200 steps: within 2% of the uncompressed final loss (measured here at
    2 ranks: bf16, fp16 and PowerSGD rank 4 within 0.7%); PowerSGD without error feedback
    ends 7% above it (the gap the feedback closes)."""
    exact, _ = _train(None)
    for compression in ["bf16", "fp16", jaxddp.PowerSGD(rank=4)]:
        loss, _ = _train(compression)
        assert abs(loss - exact) <= 0.02 * exact, (_name(compression), loss, exact)
    without, _ = _train(jaxddp.PowerSGD(rank=4), feedback=False)
    assert without > 1.04 * exact, (without, exact)


@pytest.mark.skipif(XLA, reason="the example's step is plain jax.jit: the MPI path")
def test_the_digits_example_reaches_the_uncompressed_accuracy_with_each_compression():
    """The example as a user runs it (`--compression`, its defaults: 20 epochs, PowerSGD after
    4 exact ones): no compression's test accuracy more than 0.5 points below the uncompressed
    run's (450 test images, 0.22 points each). Above it is no failure to converge: runs that
    take other paths differ by a point either way here (measured: 0.22 below to 1.1 above at
    2 and 4 ranks, jax 0.10 and 0.12); PowerSGD rank 1 without the warm-up ended 1.1 points
    below at 4 ranks."""
    from rich.console import Console

    from jaxddp.examples import digits

    def accuracy(name):
        return digits.train(digits.parse_args(["--compression", name]), Console(quiet=True))[1]

    exact = accuracy("none")
    for name in ("bf16", "fp16", "powersgd-1", "powersgd-4"):
        got = accuracy(name)
        assert got >= exact - 0.005, (name, got, exact)
