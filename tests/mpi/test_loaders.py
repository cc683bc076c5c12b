"""grain and PyTorch's DataLoader feed jaxddp's shards, on real ranks (2 and 4).

Written as the docs page "Bring your own model and data" shows. The one-process reference
runs the same pipeline on ``MPI.COMM_SELF`` on every rank; ``HALF`` (the world split in two)
saves mid-epoch and the world resumes, and the other way round: at 4 ranks that is 2 -> 4
and 4 -> 2 (with batch 32 and 16), at 2 ranks 1 -> 2 and 2 -> 1. N = 203 divides by
neither 2 nor 4, nor by the global batch 64.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import jaxddp

grain = pytest.importorskip("grain")
try:  # torch only where a CPU build is served (noxfile.py: TORCH_CPU); grain's tests run anyway
    import torch

    import jaxddp.torch
except ImportError:
    torch = None
NEEDS_TORCH = pytest.mark.skipif(
    torch is None, reason="torch is not installed (nox -s 'tests_jax(0.10)' installs it)"
)
KINDS = ["grain", pytest.param("torch", marks=NEEDS_TORCH)]

import jaxddp.grain
from tests.mpi.loader_data import FEATURES, N, TorchSamples, X, record, worker_view

MPI_SIZES = (2, 4)

rank = jaxddp.rank()
size = jaxddp.world_size()
WORLD, SELF = MPI.COMM_WORLD, MPI.COMM_SELF
HALF = WORLD.Split(color=int(rank >= size // 2), key=rank)

CLASSES, GLOBAL_BATCH, EPOCHS = 3, 64, 3
INITIAL = {
    "w1": jnp.asarray(np.random.default_rng(1).normal(size=(FEATURES, 16)) * 0.3, jnp.float32),
    "b1": jnp.zeros(16),
    "w2": jnp.asarray(np.random.default_rng(2).normal(size=(16, CLASSES)) * 0.3, jnp.float32),
}


_steps = {}


def _step(comm):
    """The optimizer and the jitted step for ``comm``, made once per communicator."""
    key = MPI._handleof(comm)
    if key not in _steps:
        _steps[key] = _make_step(comm)
    return _steps[key]


def _make_step(comm):
    tx = optax.chain(jaxddp.allreduce_gradients(comm=comm), optax.adam(1e-2))

    @jax.jit
    def step(params, opt_state, x, y, mask):
        def loss_fn(p):
            logits = jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]
            per_sample = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jaxddp.masked_mean(per_sample, mask, comm=comm)

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, step


def _loader(kind, sampler, batch_size, workers):
    if kind == "grain":
        dataset = grain.MapDataset.source(np.arange(N)).map(record)
        return jaxddp.grain.batches(dataset, sampler, batch_size)
    # spawn: JAX's threads make fork unsafe; persistent: one start for all epochs
    return jaxddp.torch.DataLoader(
        TorchSamples(),
        sampler,
        batch_size,
        num_workers=workers,
        multiprocessing_context="spawn" if workers else None,
        persistent_workers=workers > 0,
    )


def _arrays(kind, batch, mask):
    if kind == "grain":
        return batch["x"], batch["y"], mask
    x, y = batch
    return x.numpy(), y.numpy(), mask.numpy()


# A spawned torch worker imports torch (6 to 11 s of CPU on the shared machine): one per
# rank at 2 ranks; at 4 the loader reads in the rank itself (the workers are tested at 2).
TORCH_WORKERS = 1 if size == 2 else 0


def _train(kind, comm, *, resume=None, stop_after=None, workers=TORCH_WORKERS):
    """EPOCHS of the global batch GLOBAL_BATCH over ``comm``'s ranks, read by ``kind``.

    ``resume``: (params, opt_state, loader state) saved by an earlier call, on any number of
    ranks; ``stop_after``: stop after that many steps and return that triple; ``workers``:
    the torch DataLoader's (a spawned worker reads ahead, at 2 ranks). Also returns
    whether the loader's state was the sampler's after every step.
    """
    tx, step = _step(comm)
    sampler = jaxddp.DistributedSampler(N, seed=11, comm=comm)
    loader = _loader(kind, sampler, GLOBAL_BATCH // comm.Get_size(), workers)
    params, opt_state, pending = INITIAL, tx.init(INITIAL), None
    if resume is not None:
        params, opt_state, state = resume
        state = json.loads(json.dumps(state))  # as a checkpoint stores it
        if kind == "torch":
            loader.load_state_dict(state)
        else:  # grain's own way: the iterator's set_state
            pending = iter(loader)
            pending.set_state(state)
    steps, agreed = 0, True
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)  # the loaded epoch again: changes nothing
        iterator = iter(loader) if pending is None else pending
        pending = None
        for batch, mask in iterator:
            params, opt_state = step(params, opt_state, *_arrays(kind, batch, mask))
            steps += 1
            state = iterator.get_state() if kind == "grain" else loader.state_dict()
            agreed = agreed and state == sampler.state_dict()
            if steps == stop_after:
                return (params, opt_state, state), agreed
    return (params, opt_state, sampler.state_dict()), agreed


@functools.cache
def _one_process(kind):
    return _train(kind, SELF, workers=0)[0][0]


def _assert_same_params(got, expected):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def _identical_on_all_ranks(params, comm):
    flat = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(params)])
    return all(np.array_equal(flat, other) for other in comm.allgather(flat))


@pytest.mark.parametrize("kind", KINDS)
def test_w_ranks_through_the_loader_train_the_one_process_model(kind):
    (params, _, end), agreed = _train(kind, WORLD)
    same = _identical_on_all_ranks(params, WORLD)
    alone = _one_process(kind)
    assert same
    assert agreed  # the loader's state was the sampler's after every step
    assert end["position"] == N
    _assert_same_params(params, alone)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
        jax.tree.leaves(params), jax.tree.leaves(INITIAL), strict=True
    ))  # fmt: skip
    assert moved > 0.05  # it trained


# steps of 64 per epoch: ceil(203 / 64) = 4; 2 is mid-first-epoch, 4 + 3 mid-second
@pytest.mark.parametrize("stop_after", [2, 4 + 3])
@pytest.mark.parametrize("kind", KINDS)
def test_a_run_saved_mid_epoch_resumes_on_another_world_size_exactly(kind, stop_after):
    # torch: each run starts its own workers (seconds each), so one run has a worker that
    # reads ahead of the loop: the resumed one of the second epoch on W ranks
    ahead = TORCH_WORKERS if stop_after > 4 else 0
    saved, agreed_half = _train(kind, HALF, stop_after=stop_after, workers=0)  # W / 2 ...
    (wider, _, _), agreed_wide = _train(kind, WORLD, resume=saved, workers=ahead)  # ... W
    saved_wide, _ = _train(kind, WORLD, stop_after=stop_after, workers=0)  # on W ranks ...
    (narrower, _, _), _ = _train(kind, HALF, resume=saved_wide, workers=0)  # ... on W / 2
    alone = _one_process(kind)
    same = _identical_on_all_ranks(wider, WORLD), _identical_on_all_ranks(narrower, WORLD)
    assert saved[2]["position"] == (stop_after % 4) * GLOBAL_BATCH  # mid-epoch
    assert saved[2] == saved_wide[2]  # the state does not depend on the world size
    assert agreed_half
    assert agreed_wide
    assert same == (True, True)
    _assert_same_params(wider, alone)
    _assert_same_params(narrower, alone)


# The worker tests start processes (seconds each, per rank): run at 2 ranks, on every rank.
WORKERS_ONCE = pytest.mark.skipif(size > 2, reason="worker mechanics: tested at 2 ranks")


@WORKERS_ONCE
def test_grain_workers_read_the_batches_of_the_sampler():
    sampler = jaxddp.DistributedSampler(N, seed=3)
    sampler.set_epoch(2)
    expected = [(i.tolist(), m.tolist()) for i, m in sampler.batches(7)]
    sampler.set_epoch(2)
    options = grain.MultiprocessingOptions(num_workers=2)
    dataset = grain.MapDataset.source(np.arange(N)).map(record)
    loader = jaxddp.grain.batches(dataset, sampler, 7, multiprocessing_options=options)
    iterator = iter(loader)
    got, states = [], []
    for batch, mask in iterator:
        got.append((batch["x"], mask.tolist()))
        states.append(iterator.get_state()["position"])
    counts = WORLD.allgather(len(got))
    assert counts == [len(expected)] * size
    for (x, mask), (indices, real) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(x, X[indices])
        assert mask == real
    # the position counts the batches taken, never those the workers read ahead
    assert states == [min((k + 1) * 7 * size, N) for k in range(len(expected) - 1)] + [N]


@WORKERS_ONCE
def test_a_spawned_worker_imports_jaxddp_without_starting_mpi():
    """grain's and torch's spawned workers import jaxddp when they unpickle their work:
    MPI_Init there aborted (the launcher's PMI descriptor is not inherited) and the pool
    restarted the worker forever. Now the import works and the world refuses clearly."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        inside, message = pool.apply(worker_view)
    assert inside is True
    assert "not available in a data-loading worker process" in message
    assert jaxddp._runtime.world.in_loader_worker() is False  # the rank itself is no worker


def test_grain_sharding_by_jax_process_is_refused_under_mpi():
    with pytest.raises(ValueError, match=rf"JAX process 0 of 1, but this job has {size} MPI"):
        grain.sharding.ShardByJaxProcess()
    sliced = grain.MapDataset.source(np.arange(N))[rank::size]
    sampler = jaxddp.DistributedSampler(N, seed=0)
    with pytest.raises(ValueError, match="sliced with a step"):
        jaxddp.grain.batches(sliced, sampler, 4)
    with pytest.raises(TypeError, match=r"before `\.to_iter_dataset"):
        jaxddp.grain.batches(grain.MapDataset.source(np.arange(N)).to_iter_dataset(), sampler, 4)
    with pytest.raises(ValueError, match="the sampler's 203 samples, got 202"):
        jaxddp.grain.batches(np.arange(N - 1), sampler, 4)


@NEEDS_TORCH
def test_torch_batch_sampler_in_a_plain_dataloader_and_an_unwrapped_dataset():
    sampler = jaxddp.DistributedSampler(N, seed=4)
    sampler.set_epoch(1)
    expected = [(i.tolist(), m.tolist()) for i, m in sampler.batches(8)]
    sampler.set_epoch(1)
    batches = jaxddp.torch.DistributedBatchSampler(sampler, 8)
    loader = torch.utils.data.DataLoader(
        jaxddp.torch.MaskedDataset(TorchSamples()), batch_sampler=batches
    )
    length = len(loader)
    got = []
    for (x, _), mask in loader:
        got.append((x.numpy(), mask.tolist()))
    position = sampler.state_dict()["position"]
    sampler.set_epoch(2)
    plain = torch.utils.data.DataLoader(TorchSamples(), batch_sampler=batches)
    with pytest.raises((TypeError, IndexError)):
        next(iter(plain))  # an Entry is no int: the unwrapped dataset fails at once
    assert length == len(expected)
    assert position == N
    for (x, mask), (indices, real) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(x, X[indices])
        assert mask == real
