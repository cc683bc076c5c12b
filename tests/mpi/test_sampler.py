"""DistributedSampler and masked_mean on real ranks (2, 3 and 4): Flux's cases and more.

Every test gathers what it needs with collectives first and asserts afterwards, so that a
failing assertion never leaves the other ranks waiting in a collective.
"""

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxddp
from jaxddp import DistributedSampler
from jaxddp._collectives.api import py_comm

MPI_SIZES = (2, 3, 4)

rank = jaxddp.rank()
size = jaxddp.world_size()
comm = py_comm()

# Flux's cases: N divisible by the world, and not (7, 10), and fewer samples than ranks.
SIZES = [4 * size, 7, 10, 1, 2]


def flat(lists):
    return list(itertools.chain.from_iterable(lists))


def extended_order(n, *, seed, epoch, shuffle):
    """The sampler's order, extended by wrapping around to ceil(N / W) * W entries."""
    order = (
        np.random.default_rng([seed, epoch]).permutation(n).tolist() if shuffle else list(range(n))
    )
    total = math.ceil(n / size) * size
    extended = list(order)
    while len(extended) < total:
        extended += order[: total - len(extended)]
    return extended


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("n", SIZES)
def test_every_rank_gets_the_same_count_and_the_sums_add_up(n, shuffle):
    sampler = DistributedSampler(n, shuffle=shuffle, seed=4)
    sampler.set_epoch(2)
    indices, mask = sampler.indices(), sampler.mask()
    data = np.arange(1, n + 1, dtype=np.int32) * 3
    lengths = comm.allgather(len(sampler))
    total = jaxddp.allreduce(jnp.int32(data[indices].sum()), op="sum")
    count = jaxddp.allreduce(jnp.int32(mask.sum()), op="sum")
    everyone = comm.allgather(indices.tolist())
    masked = comm.allgather(indices[mask].tolist())

    assert (sampler.num_replicas, sampler.rank) == (size, rank)
    assert lengths == [math.ceil(n / size)] * size
    extended = extended_order(n, seed=4, epoch=2, shuffle=shuffle)
    # Flux's test: the allreduced sum of the shards is sum(data) + sum(data[order[:pad]])
    assert int(total) == int(data.sum()) + int(data[np.asarray(extended[n:], np.int64)].sum())
    assert flat(zip(*everyone, strict=True)) == extended  # interleaved: rank r takes r, r + W, ...
    assert set(flat(everyone)) == set(range(n))  # the union covers every sample
    assert int(count) == n
    assert sorted(flat(masked)) == list(range(n))  # each sample once where the mask holds


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("n", SIZES)
def test_a_loop_with_an_allreduce_per_batch_finishes(n, batch_size):
    """The deadlock's shape: one allreduce per batch. Every rank runs the same number."""
    sampler = DistributedSampler(n, seed=1)
    data = jnp.arange(n, dtype=jnp.float32) + 1

    traces = []

    @jax.jit
    def step(indices, mask):
        traces.append(indices.shape)
        values = data[indices]
        return jaxddp.allreduce(
            {"sum": jnp.sum(jnp.where(mask, values, 0.0)), "count": jnp.sum(mask)}, op="sum"
        )

    steps, total, count, shapes = 0, 0.0, 0, set()
    for indices, mask in sampler.batches(batch_size):
        out = step(indices, mask)
        steps += 1
        total += float(out["sum"])
        count += int(out["count"])
        shapes.add((indices.shape, mask.shape))
    counts = comm.allgather(steps)

    assert counts == [math.ceil(math.ceil(n / size) / batch_size)] * size
    assert shapes == {((batch_size,), (batch_size,))}
    assert len(traces) == 1  # one shape, one compilation, last batch included
    assert count == n
    assert total == n * (n + 1) / 2


@pytest.mark.parametrize("n", [7, 10, 4 * size + 1, 1000])
def test_masked_mean_is_the_exact_mean_of_all_samples(n):
    data = np.random.default_rng(n).normal(size=n).astype(np.float32)
    sampler = DistributedSampler(n, seed=2)
    mean = jax.jit(jaxddp.masked_mean)
    whole = float(mean(data[sampler.indices()], sampler.mask()))
    # per-sample vectors: the mask broadcasts over the trailing axis
    pairs = np.stack([data, 2 * data], axis=1)
    columns = np.asarray(mean(pairs[sampler.indices()], sampler.mask()))
    unmasked = float(jaxddp.allreduce(jnp.mean(data[sampler.indices()]), op="mean"))
    gathered = comm.allgather((whole, columns.tolist()))

    assert all(g == gathered[0] for g in gathered)  # identical on every rank
    np.testing.assert_allclose(whole, data.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(columns, [data.mean(), 2 * data.mean()], rtol=1e-5, atol=1e-6)
    if n % size:
        # without the mask, the wrapped duplicates bias the mean
        # (https://github.com/pytorch/pytorch/issues/25162)
        assert abs(unmasked - data.mean()) > 1e-6


def test_masked_mean_over_batches_where_some_ranks_have_only_padding():
    # N = 1 on every world: one rank holds the sample, the others only its padded copies
    sampler = DistributedSampler(1, shuffle=False)
    values = [float(jaxddp.masked_mean(jnp.array([5.0]), mask)) for _, mask in sampler.batches(1)]
    nothing = float(jaxddp.masked_mean(jnp.zeros(2), jnp.zeros(2, bool)))
    assert values == [5.0]
    assert math.isnan(nothing)


def test_state_is_identical_on_every_rank_and_resumes_at_every_batch():
    n, batch_size = 10, 2
    nb = DistributedSampler(n, seed=3).num_batches(batch_size)
    results = []
    for k in range(nb + 1):
        first = DistributedSampler(n, seed=3)
        first.set_epoch(1)
        batches = first.batches(batch_size)
        done = [next(batches) for _ in range(k)]
        state = first.state_dict()
        resumed = DistributedSampler(n, seed=3)
        resumed.load_state_dict(state)
        resumed.set_epoch(1)
        rest = list(resumed.batches(batch_size))
        kept = flat(i[m].tolist() for i, m in done + rest)
        results.append((comm.allgather(state), comm.allgather(kept), len(rest)))
        counts = comm.allgather(len(rest))
        assert counts == [nb - k] * size

    for states, kept, _ in results:
        assert all(s == states[0] for s in states)
        assert sorted(flat(kept)) == list(range(n))  # nothing skipped, nothing repeated


# -- W ranks with batch B are one process with batch W * B ---------------------------------


def interleaved(per_rank):
    """Rank-interleaved concatenation of every rank's list: entry j of each, then j + 1."""
    return [x for entries in zip(*per_rank, strict=True) for x in entries]


def one_process(n, global_batch, *, epoch=0, state=None, **kwargs):
    sampler = DistributedSampler(n, num_replicas=1, rank=0, **kwargs)
    if state is not None:
        sampler.load_state_dict(state)
    sampler.set_epoch(epoch)
    return [(i.tolist(), m.tolist()) for i, m in sampler.batches(global_batch)]


def gathered(batches):
    """Each step's batch of all ranks, interleaved, as one process's (indices, mask)."""
    everyone = comm.allgather([(i.tolist(), m.tolist()) for i, m in batches])
    steps = {len(b) for b in everyone}
    assert len(steps) == 1, steps  # the same number of steps on every rank
    return [
        (interleaved([b[k][0] for b in everyone]), interleaved([b[k][1] for b in everyone]))
        for k in range(steps.pop())
    ]


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("n", [203, 1, size - 1 or 1, 7, 10, 4 * size, 4 * size * 8 + 1])
def test_the_ranks_batches_together_are_one_process_batches(n, batch_size, shuffle):
    sampler = DistributedSampler(n, shuffle=shuffle, seed=6)
    results = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        results.append(gathered(sampler.batches(batch_size)))

    for epoch, together in enumerate(results):
        alone = one_process(n, size * batch_size, epoch=epoch, shuffle=shuffle, seed=6)
        assert together == alone  # every step, the last (short, padded) one included
        real = [i for indices, mask in together for i, m in zip(indices, mask, strict=True) if m]
        assert sorted(real) == list(range(n))  # padding never counts a sample twice


GLOBAL_BATCH = 12  # divides by 2, 3 and 4: the same global batch on every world size


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("n", [203, 5, 48])
def test_a_run_saved_on_another_world_size_resumes_with_the_remaining_batches(n, shuffle):
    """Saved at each batch boundary by W = 2 or 4 ranks (computed here: a sampler with
    explicit num_replicas and rank is pure), resumed on this world's real ranks."""
    saved_on = 4 if size == 2 else 2
    kwargs = {"shuffle": shuffle, "seed": 9}
    whole = one_process(n, GLOBAL_BATCH, epoch=1, **kwargs)
    results = []
    for k in range(len(whole) + 1):
        states = []
        for r in range(saved_on):
            first = DistributedSampler(n, num_replicas=saved_on, rank=r, **kwargs)
            first.set_epoch(1)
            batches = first.batches(GLOBAL_BATCH // saved_on)
            for _ in range(k):
                next(batches)
            states.append(first.state_dict())
        resumed = DistributedSampler(n, **kwargs)
        resumed.load_state_dict(json.loads(json.dumps(states[0])))
        resumed.set_epoch(1)
        rest = gathered(resumed.batches(GLOBAL_BATCH // size))
        results.append((k, states, rest, resumed.state_dict()))

    for k, states, rest, end in results:
        assert all(state == states[0] for state in states)
        assert "num_replicas" not in states[0]
        assert rest == whole[k:]  # exactly the remaining global batches
        assert end["position"] == n


# -- load_state_dict agrees across ranks ----------------------------------------------------


def test_different_states_on_different_ranks_are_an_error_on_every_rank():
    sampler = DistributedSampler(203, seed=1)
    state = sampler.state_dict()
    mine = {**state, "position": 0 if rank == 0 else 2 * size}
    with pytest.raises(
        ValueError, match=rf"same state.*`position` \(rank 0: 0, rank 1: {2 * size}"
    ):
        sampler.load_state_dict(mine)
    with pytest.raises(ValueError, match=r"same state.*`epoch` \(rank 0: 0, rank 1: 1"):
        sampler.load_state_dict({**state, "epoch": int(rank > 0)})
    sampler.load_state_dict({**state, "position": size})  # the same everywhere: fine
    assert sampler.state_dict()["position"] == size


def test_an_invalid_state_on_one_rank_is_an_error_on_every_rank():
    sampler = DistributedSampler(203, seed=1)
    state = sampler.state_dict()
    last = size - 1
    if rank == last:
        match = r"`seed=1` like this sampler's, got `seed=2`"
    else:
        match = rf"load a valid state.*errors on 1 of {size} ranks.*rank {last}: ValueError"
    with pytest.raises(ValueError, match=match):
        sampler.load_state_dict({**state, "seed": 2 if rank == last else 1})


def test_a_position_this_world_size_cannot_continue_is_an_error_on_every_rank():
    sampler = DistributedSampler(203, seed=1)
    state = {**sampler.state_dict(), "position": size + 1}
    with pytest.raises(ValueError, match=rf"multiple of `num_replicas={size}`, got {size + 1}"):
        sampler.load_state_dict(state)


# -- the one-time consistency check ---------------------------------------------------------


def test_a_different_data_size_on_one_rank_is_an_error_on_every_rank():
    with pytest.raises(ValueError, match=r"same `data` size.*`data` size \(rank 0: 10, rank 1: 11"):
        DistributedSampler(10 + (rank == 1))


def test_a_different_seed_or_shuffle_is_an_error_on_every_rank():
    with pytest.raises(ValueError, match=r"`seed` \(rank 0: 0, rank 1: 1"):
        DistributedSampler(10, seed=rank)
    with pytest.raises(ValueError, match=r"`shuffle` \(rank 0: True, rank 1: False"):
        DistributedSampler(10, shuffle=rank == 0)
    with pytest.raises(ValueError, match=r"`drop_last` \(rank 0: False, rank 1: True"):
        DistributedSampler(10, drop_last=rank == 1)


def test_bad_arguments_on_one_rank_are_an_error_on_every_rank():
    last = size - 1
    if rank == last:
        match = r"`data` to be a positive number of samples, got 0"
    else:
        match = rf"errors on 1 of {size} ranks.*rank {last}: ValueError: Expected `data`"
    with pytest.raises(ValueError, match=match):
        DistributedSampler(0 if rank == last else 10)


def test_num_replicas_that_leaves_shards_unread_is_an_error():
    with pytest.raises(ValueError, match=rf"leave shards \[{size}\] to no rank"):
        DistributedSampler(10, num_replicas=size + 1)
    unread = ", ".join(map(str, range(1, size)))
    with pytest.raises(ValueError, match=rf"leave shards \[{unread}\] to no rank"):
        DistributedSampler(10, rank=0)


def test_explicit_num_replicas_and_rank_never_talk_to_the_world():
    # Only rank 0 builds these: a collective inside would hang the job (and the watchdog
    # would report it), so passing shows that the explicit form is pure.
    if rank == 0:
        shards = [DistributedSampler(7, num_replicas=3, rank=r).indices() for r in range(3)]
        assert sum(len(s) for s in shards) == 9
    assert comm.allgather(rank) == list(range(size))  # everyone meets again here
