"""``JAXDDP_COLLECTIVES=xla`` on real ranks: ``jaxddp.spmd`` runs each step over the ranks' mesh
with JAX's own collectives (gloo across the processes on this CPU machine), and everything
equals the MPI path.

Every test compares the step wrapped in ``jaxddp.spmd`` (the XLA path) with the same step
under plain ``jax.jit`` (the MPI path: a jitted function outside ``spmd`` keeps jaxddp's MPI
collectives in either mode) on the same ranks, and, for training, with one process on the
global batch: to 1e-6.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from mpi4py import MPI

import jaxddp
from jaxddp._collectives.signature import TreeMismatchError

MPI_SIZES = (2, 3, 4)  # 3: a world that does not divide evenly (#57: equal at 2, 3 and 4)
MPI_VARIANTS = {"xla": {"JAXDDP_COLLECTIVES": "xla"}}
MPI_VARIANTS_ONLY = True

rank = jaxddp.rank()
size = jaxddp.world_size()
BATCH = 6  # per rank


def test_jax_runs_as_one_distributed_job_of_the_mpi_world():
    assert jax.process_count() == size
    assert jax.process_index() == rank
    assert len(jax.devices()) == size  # one device per rank, every rank's in the mesh


def _tree(seed):
    rng = np.random.default_rng(seed)
    return {
        "f32": jnp.asarray(rng.standard_normal((3, 5)), jnp.float32),
        "bf16": jnp.asarray(rng.standard_normal(7), jnp.bfloat16),
        "i32": jnp.asarray(rng.integers(-50, 50, 4), jnp.int32),
        "flag": jnp.asarray(rng.random(3) < 0.5),
        "scalar": jnp.float32(seed),
    }


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_allreduce_equals_the_mpi_path(op):
    tree = _tree(rank)
    on_xla = jaxddp.spmd(lambda t: jaxddp.allreduce(t, op=op))(tree)
    on_mpi = jax.jit(lambda t: jaxddp.allreduce(t, op=op))(tree)
    for key in tree:
        assert on_xla[key].dtype == on_mpi[key].dtype, key
        assert on_xla[key].shape == on_mpi[key].shape, key
        np.testing.assert_allclose(
            np.asarray(on_xla[key], np.float64), np.asarray(on_mpi[key], np.float64), rtol=1e-6
        )


def _nans_and_zeros(dtype):
    """A NaN on rank 1 alone, on rank 0 alone; -0.0 on even ranks and +0.0 on odd ones, and
    the other way round; a plain value."""
    x = np.array([rank + 1.0, rank + 1.0, 0.0, 0.0, -1.0 - rank], dtype)
    x[0] = np.nan if rank == 1 else x[0]
    x[1] = np.nan if rank == 0 else x[1]
    x[2] = -0.0 if rank % 2 == 0 else 0.0
    x[3] = 0.0 if rank % 2 == 0 else -0.0
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["max", "min"])
def test_a_max_or_min_keeps_another_ranks_nan_and_orders_signed_zeros_as_the_mpi_path(op, dtype):
    # Before, pmax/pmin dropped rank 1's NaN (2.0 where the MPI path gave NaN), and the zeros
    # came out as whichever rank's came first
    jax.config.update("jax_enable_x64", dtype == np.float64)
    try:
        x = jnp.asarray(_nans_and_zeros(dtype))
        on_xla = np.asarray(jaxddp.spmd(lambda t: jaxddp.allreduce(t, op=op))(x))
        on_mpi = np.asarray(jax.jit(lambda t: jaxddp.allreduce(t, op=op))(x))
    finally:
        jax.config.update("jax_enable_x64", False)
    assert on_xla.dtype == on_mpi.dtype == dtype
    itype = np.int32 if dtype == np.float32 else np.int64
    np.testing.assert_array_equal(on_xla.view(itype), on_mpi.view(itype))  # every bit
    assert np.isnan(on_xla[:2]).all(), on_xla
    zero = 0.0 if op == "max" else -0.0  # IEEE 754's maximum and minimum: -0.0 < +0.0
    assert np.array_equal(np.signbit(on_xla[2:4]), np.signbit([zero, zero])), on_xla
    assert on_xla[4] == (-1.0 if op == "max" else -float(size)), on_xla


@pytest.mark.parametrize("root", [0, size - 1])
def test_broadcast_and_reduce_equal_the_mpi_path(root):
    tree = _tree(10 + rank)
    for fn, exact in (
        (lambda t: jaxddp.broadcast(t, root=root), True),
        (lambda t: jaxddp.reduce(t, "sum", root=root), False),  # sums in another order
    ):
        on_xla, on_mpi = jaxddp.spmd(fn)(tree), jax.jit(fn)(tree)
        for key in tree:
            a, b = np.asarray(on_xla[key], np.float64), np.asarray(on_mpi[key], np.float64)
            if exact or rank != root:  # a broadcast's bits, a non-root's own values
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_collective_over_another_communicator_is_refused_on_every_rank():
    pairs = MPI.COMM_WORLD.Split(color=rank // 2, key=rank)
    step = jaxddp.spmd(lambda x: jaxddp.allreduce(x, op="sum", comm=pairs))
    with pytest.raises(NotImplementedError, match="comm=` another communicator"):
        step(jnp.float32(rank))
    outside = jax.jit(lambda x: jaxddp.allreduce(x, op="sum", comm=pairs))  # the MPI path
    assert float(outside(jnp.float32(rank))) == sum(
        range(rank // 2 * 2, min(rank // 2 * 2 + 2, size))
    )
    pairs.Free()


def _global_batch(step):
    """Global batch ``step`` (every rank makes all of it), and which rows are real: the last
    rank's last two rows are padding, as a sampler pads an uneven data set."""
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((size * BATCH, 4)).astype(np.float32)
    y = rng.standard_normal((size * BATCH, 1)).astype(np.float32)
    mask = np.ones(size * BATCH, bool)
    mask[-2:] = False
    return x, y, mask


def _mine(a):
    return a[rank * BATCH : (rank + 1) * BATCH]


def _loss(params, x, y, mask, reduce):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    per_example = jnp.sum((h @ params["w2"] - y) ** 2, axis=-1)
    return reduce(per_example, mask)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.standard_normal((4, 8)) / 2, jnp.float32),
        "b1": jnp.zeros(8, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((8, 1)) / 3, jnp.float32),
    }


def _train(tx, wrap, steps=4):
    params = _params()
    opt_state = tx.init(params)
    traces = []

    def step(params, opt_state, x, y, mask):
        traces.append(1)
        loss, grads = jax.value_and_grad(_loss)(params, x, y, mask, jaxddp.masked_mean)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    run = wrap(step)
    losses = []
    for k in range(steps):
        x, y, mask = _global_batch(k)
        params, opt_state, loss = run(params, opt_state, _mine(x), _mine(y), _mine(mask))
        losses.append(float(loss))
    return params, losses, len(traces)


def _one_process(inner, steps=4):
    params = _params()
    opt_state = inner.init(params)

    def masked(v, m):
        return jnp.sum(jnp.where(m, v, 0)) / jnp.sum(m)

    for k in range(steps):
        x, y, mask = _global_batch(k)
        grads = jax.grad(_loss)(params, x, y, mask, masked)
        updates, opt_state = inner.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("sharded", [False, True], ids=["allreduce_gradients", "shard_optimizer"])
def test_training_equals_the_mpi_path_and_one_process_and_compiles_once(sharded):
    def tx():
        if sharded:
            return jaxddp.shard_optimizer(optax.adam(1e-2))
        return optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))

    on_xla, losses_xla, traces = _train(tx(), jaxddp.spmd)
    on_mpi, losses_mpi, _ = _train(tx(), jax.jit)
    alone = _one_process(optax.adam(1e-2))
    # four steps, one compilation; the sharded optimizer's state starts the same on every
    # rank (zeros) and is per-rank after the first step: one more, for the second step
    assert traces == (2 if sharded else 1)
    np.testing.assert_allclose(losses_xla, losses_mpi, rtol=1e-6)
    for key in alone:
        np.testing.assert_allclose(on_xla[key], on_mpi[key], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(on_xla[key], alone[key], rtol=1e-6, atol=1e-6)


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.norm = jaxddp.SyncBatchNorm(8, use_fast_variance=False, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, mask):
        return self.out(nnx.relu(self.norm(self.hidden(x), mask=mask)))


def _nnx_run(wrap, remat=False):
    model = _Net(nnx.Rngs(0))
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.sgd(0.05, momentum=0.9))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y, mask):
        def loss_fn(model):
            per_example = jnp.sum((model(x, mask) - y) ** 2, axis=-1)
            return jaxddp.masked_mean(per_example, mask)

        if remat:  # gradient checkpointing: the forward pass runs again in the backward one
            loss_fn = nnx.remat(loss_fn)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    run = wrap(step)
    for k in range(3):
        x, y, mask = _global_batch(k)
        run(model, optimizer, _mine(x), _mine(y), _mine(mask))
    return nnx.state(model)


def test_an_nnx_step_with_sync_batch_norm_equals_the_mpi_path():
    on_xla = _nnx_run(jaxddp.spmd)
    on_mpi = _nnx_run(lambda f: f)  # nnx.jit alone: jaxddp's MPI collectives
    flat_xla, flat_mpi = jax.tree.leaves(on_xla), jax.tree.leaves(on_mpi)
    assert len(flat_xla) == len(flat_mpi) > 0
    for a, b in zip(flat_xla, flat_mpi, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # batch statistics and parameters are the same on every rank
    assert jaxddp.synchronize(nnx.state(_Net(nnx.Rngs(rank))), root=0) is not None
    mine = np.concatenate([np.ravel(x) for x in flat_xla]).astype(np.float64)
    assert np.array_equal(jaxddp.allreduce(mine, op="max"), jaxddp.allreduce(mine, op="min"))


def test_sync_batch_norm_and_masked_mean_under_remat_equal_the_step_without_on_both_paths():
    # Before, the MPI path (nnx.jit alone) raised NotImplementedError: "Effects not supported
    # in AD of `checkpoint`/`remat`" (the collectives' mpi4jax ordered effect)
    without = jax.tree.leaves(_nnx_run(lambda f: f))
    for wrap in (jaxddp.spmd, lambda f: f):
        got = jax.tree.leaves(_nnx_run(wrap, remat=True))
        assert len(got) == len(without) > 0
        for a, b in zip(got, without, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_another_batch_shape_on_one_rank_is_an_error_on_every_rank():
    step = jaxddp.spmd(lambda x: jaxddp.allreduce(x.sum(), op="sum"))
    x = jnp.ones(BATCH - 1 if rank == size - 1 else BATCH)
    with pytest.raises(TreeMismatchError, match=r"differs across ranks.*float32\[5\]"):
        step(x)
    tree = {"x": jnp.ones(3)} if rank == 0 else {"y": jnp.ones(3)}
    with pytest.raises(TreeMismatchError):
        step(tree)
    assert float(step(jnp.ones(BATCH))) == size * BATCH  # and the next call works


def test_join_trains_uneven_streams_on_the_xla_path():
    params = {"w": jnp.zeros(4, jnp.float32)}

    @jaxddp.spmd
    def step(params, x, mask):
        def loss_fn(p):
            return jaxddp.masked_mean((x @ p["w"] - 1.0) ** 2, mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jaxddp.allreduce(grads)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    stream = [np.full((3, 4), rank + k, np.float32) for k in range(rank + 1)]  # uneven
    steps = 0
    for batch, mask in jaxddp.join(stream, batch_size=3):
        params, _ = step(params, batch, mask)
        steps += 1
    assert steps == size
    w = np.asarray(params["w"])
    assert np.array_equal(jaxddp.allreduce(w, op="max"), jaxddp.allreduce(w, op="min"))


def test_checkpoints_background_and_sliced_save_and_resume_on_the_xla_path(tmp_path_factory):
    # one directory for every rank: rank 0's, broadcast
    directory = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("xla")) if rank == 0 else None)
    tx = jaxddp.shard_optimizer(optax.adam(1e-2))
    params = _params()
    opt_state = tx.init(params)

    @jaxddp.spmd
    def step(params, opt_state, x, y, mask):
        grads = jax.grad(_loss)(params, x, y, mask, jaxddp.masked_mean)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    manager = jaxddp.CheckpointManager(directory, max_to_keep=2)  # background, the default
    for k in range(3):
        x, y, mask = _global_batch(k)
        params, opt_state = step(params, opt_state, _mine(x), _mine(y), _mine(mask))
        manager.save(k, {"params": params, "opt": opt_state})
    manager.wait_until_finished()
    target = {"params": _params(), "opt": tx.init(_params())}
    restored = manager.restore(None, target=target)
    assert manager.latest_step() == 2
    manager.close()
    saved = {"params": params, "opt": opt_state}
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keyword_arguments_static_arguments_and_constant_results():
    @jaxddp.spmd(static_argnums=1)
    def step(x, scale, *, shift):
        return {"y": jaxddp.allreduce(x * scale + shift, op="sum"), "const": 3}

    out = step(jnp.float32(rank), 2, shift=jnp.float32(1.0))
    assert float(out["y"]) == sum(2 * r + 1 for r in range(size))
    assert int(out["const"]) == 3


def test_nnx_objects_by_keyword_or_in_a_container_are_updated_as_nnx_jit_does():
    def run(wrap, how):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(
            model, optax.chain(jaxddp.allreduce_gradients(), optax.sgd(0.5)), wrt=nnx.Param
        )

        @nnx.jit
        def step(pair, x):
            model, optimizer = pair

            def loss_fn(m):
                return jnp.mean((m(x) - 1.0) ** 2)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        run_step = wrap(step)
        for k in range(3):
            x = jnp.full((2, 3), float(rank + k))
            if how == "keyword":
                run_step(pair=(model, optimizer), x=x)
            else:
                run_step((model, optimizer), x)
        return np.asarray(model.kernel[...])

    for how in ("keyword", "container"):
        np.testing.assert_allclose(run(jaxddp.spmd, how), run(lambda f: f, how), rtol=1e-6)


def test_python_numbers_stay_weakly_typed_and_result_shapes_follow_the_inputs():
    step = jaxddp.spmd(lambda x, s: jnp.squeeze(jaxddp.allreduce(x * s, op="sum")))
    out = step(jnp.ones(2, jnp.bfloat16), 0.5)
    assert out.dtype == jnp.bfloat16  # a Python float does not promote, as under jax.jit
    for n in (1, 4, 1, 4):  # (1,) squeezes to a scalar, (4,) does not: each its own shape
        assert step(jnp.ones(n), 1.0).shape == jax.jit(jnp.squeeze)(jnp.ones(n)).shape


def test_a_collective_on_one_rank_only_raises_on_every_rank_and_spmd_must_be_outermost():
    def extra(x):
        y = jaxddp.allreduce(x, op="sum")
        if jaxddp.rank() == 0:  # a branch on the rank: one more collective on rank 0
            y = y + jaxddp.allreduce(x, op="max")
        return y

    with pytest.raises(TreeMismatchError, match=r"the end of the step wrapped in `jaxddp\.spmd`"):
        jaxddp.spmd(extra)(jnp.ones(2))
    inner = jaxddp.spmd(lambda x: x * 2)
    with pytest.raises(TypeError, match="must be the outermost transformation"):
        jax.jit(inner)(jnp.ones(2))
    assert float(jaxddp.spmd(jnp.sum)(jnp.zeros((0, 3)))) == 0.0  # no data at all


def test_the_wrapped_step_lowers_for_cuda_to_xlas_all_reduce_without_an_mpi_call():
    """The GPU path's program, built on this CPU machine: the step's collectives become
    XLA's own all-reduce (NCCL on GPUs), and no MPI custom call is left in it."""
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))

    def step(params, opt_state, x, y, mask):
        grads = jax.grad(_loss)(params, x, y, mask, jaxddp.masked_mean)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    run = jaxddp.spmd(step)
    x, y, mask = _global_batch(0)
    params = _params()
    args = (params, tx.init(params), _mine(x), _mine(y), _mine(mask))
    run(*args)
    (form,) = run._forms.values()
    leaves = jax.tree.leaves({"args": list(args), "kwargs": {}, "nnx_state": None})
    device = jax.local_devices()[0]
    blocks = [form.make(i, jax.device_put(leaf, device)) for i, leaf in enumerate(leaves)]
    text = form.run.trace(*blocks).lower(lowering_platforms=("cuda",)).as_text()
    assert "all_reduce" in text
    assert "custom_call" not in text
