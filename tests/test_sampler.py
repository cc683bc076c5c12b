"""DistributedSampler and masked_mean in one process, for every rank of a world at once.

A sampler with explicit `num_replicas` and `rank` is a pure computation, so every rank's
shard of a world of W ranks can be built here and checked against a literal reference.
"""

import collections
import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxddp
from jaxddp import DistributedSampler

WORLDS = range(1, 9)


def sizes(w):
    return sorted({1, 2, 7, 10, 4 * w, 1003})


def reference(n, w, *, seed=0, epoch=0, shuffle=True, drop_last=False):
    """The sampler's specification, literally: (order, padded order, per-rank shards, their masks).

    The padded order is the order (cut to a multiple of W with drop_last) extended by
    wrapping around to s * W entries; rank r takes its entries r, r + W, r + 2W, ...
    """
    order = (
        np.random.default_rng([seed, epoch]).permutation(n).tolist() if shuffle else list(range(n))
    )
    if drop_last:
        s = n // w
        extended = order[: s * w]
    else:
        s = math.ceil(n / w)
        extended = list(order)
        while len(extended) < s * w:
            extended += order[: s * w - len(extended)]
    shards = [extended[r::w] for r in range(w)]
    masks = [[i * w + r < n for i in range(s)] for r in range(w)]
    return order, extended, shards, masks


def interleave(arrays):
    """Rank-interleaved concatenation: entry j of every rank, then entry j + 1, ..."""
    return np.stack([np.asarray(a) for a in arrays], axis=1).reshape(-1).tolist()


def world(n, w, **kwargs):
    return [DistributedSampler(n, num_replicas=w, rank=r, **kwargs) for r in range(w)]


CASES = [(n, w) for w in WORLDS for n in sizes(w)]


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize(("n", "w"), CASES, ids=[f"N={n}-W={w}" for n, w in CASES])
def test_padded_shards_match_the_definition(n, w, shuffle):
    samplers = world(n, w, shuffle=shuffle, seed=3)
    order, extended, blocks, masks = reference(n, w, seed=3, shuffle=shuffle)
    s = math.ceil(n / w)
    pad = s * w - n
    assert [len(x) for x in samplers] == [s] * w
    for sampler, block, mask in zip(samplers, blocks, masks, strict=True):
        indices = sampler.indices()
        assert indices.dtype == np.int64
        assert indices.tolist() == block  # every W-th entry of the padded order
        assert sampler.mask().dtype == np.bool_
        assert sampler.mask().tolist() == mask
        items = list(sampler)
        assert items == block
        assert all(type(i) is int for i in items)
    everything = np.concatenate([x.indices() for x in samplers])
    # the multiset over all ranks is order + order[:pad] (repeated when pad > N)
    assert collections.Counter(everything.tolist()) == collections.Counter(extended)
    if pad <= n:
        assert collections.Counter(everything.tolist()) == collections.Counter(order + order[:pad])
    # Flux's check: the sum of the shards is sum(data) + sum(data[order[:pad]])
    data = np.arange(n) * 3 + 1
    assert sum(int(data[x.indices()].sum()) for x in samplers) == int(data.sum()) + int(
        data[np.asarray(extended[n:], dtype=np.int64)].sum()
    )
    # the masks count N, and the masked entries are every sample exactly once
    assert sum(int(x.mask().sum()) for x in samplers) == n
    kept = np.concatenate([x.indices()[x.mask()] for x in samplers])
    assert sorted(kept.tolist()) == list(range(n))


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize(("n", "w"), CASES, ids=[f"N={n}-W={w}" for n, w in CASES])
def test_drop_last_drops_the_tail(n, w, shuffle):
    if n < w:
        with pytest.raises(ValueError, match=r"`drop_last=True`.*every rank would get nothing"):
            DistributedSampler(n, num_replicas=w, rank=0, drop_last=True)
        return
    samplers = world(n, w, shuffle=shuffle, drop_last=True, seed=5)
    _, extended, blocks, _ = reference(n, w, seed=5, shuffle=shuffle, drop_last=True)
    assert [len(x) for x in samplers] == [n // w] * w
    for sampler, block in zip(samplers, blocks, strict=True):
        assert sampler.indices().tolist() == block
        assert sampler.mask().all()
    everything = interleave([x.indices() for x in samplers])
    assert everything == extended
    assert len(set(everything)) == len(everything)  # nothing repeated


@pytest.mark.parametrize("n", [7, 10, 1003])
def test_shuffle_differs_between_epochs_and_matches_across_ranks(n):
    w = 3
    samplers = world(n, w, seed=11)
    seen = []
    for epoch in range(3):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        combined = interleave([x.indices() for x in samplers])
        # every rank's shard is a strided slice of one and the same order
        assert combined == reference(n, w, seed=11, epoch=epoch)[1]
        seen.append(combined)
    assert seen[0] != seen[1] != seen[2] != seen[0]
    # a seed changes the order; the same (seed, epoch) gives it back
    other = DistributedSampler(n, num_replicas=1, rank=0, seed=12).indices().tolist()
    assert other != reference(n, 1, seed=11)[0]
    again = DistributedSampler(n, num_replicas=1, rank=0, seed=11)
    again.set_epoch(2)
    assert again.indices().tolist() == reference(n, 1, seed=11, epoch=2)[0]


def test_unshuffled_order_ignores_epoch_and_seed():
    a = DistributedSampler(10, num_replicas=3, rank=2, shuffle=False, seed=4)
    a.set_epoch(7)
    assert a.indices().tolist() == [2, 5, 8, 1]  # positions 2, 5, 8, 11


def test_data_with_len_and_numpy_integers():
    assert len(DistributedSampler(list(range(7)), num_replicas=2, rank=0)) == 4
    assert len(DistributedSampler(np.zeros((9, 2)), num_replicas=2, rank=1)) == 5
    s = DistributedSampler(np.int64(7), num_replicas=np.int32(2), rank=np.int8(1), seed=np.uint8(1))
    assert (s.data_size, s.num_replicas, s.rank) == (7, 2, 1)


def test_fewer_samples_than_ranks_wraps_around():
    samplers = world(2, 5, shuffle=False)
    assert [x.indices().tolist() for x in samplers] == [[0], [1], [0], [1], [0]]
    assert [x.mask().tolist() for x in samplers] == [[True], [True], [False], [False], [False]]


def test_indices_and_mask_are_fresh_copies():
    sampler = DistributedSampler(10, num_replicas=2, rank=0)
    indices = sampler.indices()
    indices[:] = -1
    mask = sampler.mask()
    mask[:] = False
    assert (sampler.indices() >= 0).all()
    assert sampler.mask().all()


# -- batches --------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 3, 4, 64])
@pytest.mark.parametrize(("n", "w"), CASES, ids=[f"N={n}-W={w}" for n, w in CASES])
def test_batches_are_full_and_equal_in_number(n, w, batch_size):
    samplers = world(n, w, seed=1)
    s = math.ceil(n / w)
    per_rank = [list(x.batches(batch_size)) for x in samplers]
    assert [len(b) for b in per_rank] == [math.ceil(s / batch_size)] * w
    assert [x.num_batches(batch_size) for x in samplers] == [len(per_rank[0])] * w
    kept = []
    for sampler, batches in zip(samplers, per_rank, strict=True):
        indices, mask = sampler.indices(), sampler.mask()
        for k, (batch, batch_mask) in enumerate(batches):
            assert batch.shape == (batch_size,)
            assert batch_mask.shape == (batch_size,)
            assert batch.dtype == np.int64
            assert batch_mask.dtype == np.bool_
            real = indices[k * batch_size : (k + 1) * batch_size]
            assert batch[: len(real)].tolist() == real.tolist()
            real_mask = mask[k * batch_size : (k + 1) * batch_size]
            assert batch_mask[: len(real)].tolist() == real_mask.tolist()
            assert not batch_mask[len(real) :].any()  # the batch's own padding
            assert ((batch >= 0) & (batch < n)).all()  # valid indices, even as padding
            kept.extend(batch[batch_mask].tolist())
    assert sorted(kept) == list(range(n))


@pytest.mark.parametrize("batch_size", [1, 3, 4])
@pytest.mark.parametrize(("n", "w"), [(7, 2), (10, 3), (1003, 4), (64, 8)])
def test_batches_drop_last(n, w, batch_size):
    samplers = world(n, w)
    # only batches whose W * B positions are all real: as one process with batch W * B
    count = n // (w * batch_size)
    if count == 0:
        with pytest.raises(ValueError, match=r"`batch_size` to be at most"):
            samplers[0].batches(batch_size, drop_last=True)
        return
    per_rank = [list(x.batches(batch_size, drop_last=True)) for x in samplers]
    assert [len(b) for b in per_rank] == [count] * w
    assert samplers[0].num_batches(batch_size, drop_last=True) == count
    for sampler, batches in zip(samplers, per_rank, strict=True):
        flat = np.concatenate([b for b, _ in batches]).tolist()
        assert flat == sampler.indices()[: len(flat)].tolist()
        assert all(m.all() for _, m in batches)


def test_batches_drop_last_with_no_full_batch_is_an_error():
    sampler = DistributedSampler(7, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"`batch_size`.*at most 3 .*2 ranks.*7 samples.*got 4"):
        sampler.batches(4, drop_last=True)
    assert len(list(sampler.batches(3, drop_last=True))) == 1


# -- W ranks with batch B see one process's batches of W * B -------------------------------


def one_process(n, global_batch, *, epoch=0, drop_last=False, **kwargs):
    sampler = DistributedSampler(n, num_replicas=1, rank=0, **kwargs)
    sampler.set_epoch(epoch)
    return [(i.tolist(), m.tolist()) for i, m in sampler.batches(global_batch, drop_last=drop_last)]


def ranks_together(n, w, batch_size, *, epoch=0, drop_last=False, **kwargs):
    """Batch k of every rank, interleaved: the indices and masks of one global batch each."""
    per_rank = []
    for sampler in world(n, w, **kwargs):
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler.batches(batch_size, drop_last=drop_last)))
    assert len({len(b) for b in per_rank}) == 1  # the same number of steps on every rank
    return [
        (interleave([b[k][0] for b in per_rank]), interleave([b[k][1] for b in per_rank]))
        for k in range(len(per_rank[0]))
    ]


EQUIVALENCE = [(n, w) for w in (2, 3, 4, 8) for n in (1, 2, 3, w - 1, 7, 10, 64, 203) if n]


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("batch_size", [1, 3, 16])
@pytest.mark.parametrize(("n", "w"), EQUIVALENCE, ids=[f"N={n}-W={w}" for n, w in EQUIVALENCE])
def test_the_ranks_batches_together_are_the_one_process_batches(n, w, batch_size, shuffle):
    for epoch in range(3):
        together = ranks_together(n, w, batch_size, epoch=epoch, shuffle=shuffle, seed=8)
        alone = one_process(n, w * batch_size, epoch=epoch, shuffle=shuffle, seed=8)
        assert together == alone  # every step, the last short one included, padding too
        # the real samples of the epoch are each sample once, the last batch's included
        real = [i for indices, mask in alone for i, m in zip(indices, mask, strict=True) if m]
        assert sorted(real) == list(range(n))
        last_indices, last_mask = alone[-1]
        start = (len(alone) - 1) * w * batch_size
        order = DistributedSampler(n, num_replicas=1, rank=0, shuffle=shuffle, seed=8)
        order.set_epoch(epoch)
        # the last step's real samples are the tail of the order, its padding is mask False
        assert [i for i, m in zip(last_indices, last_mask, strict=True) if m] == order.indices()[
            start:
        ].tolist()
        assert sum(last_mask) == n - start
        if n >= w * batch_size:
            dropped = ranks_together(
                n, w, batch_size, epoch=epoch, drop_last=True, shuffle=shuffle, seed=8
            )
            kept = one_process(
                n, w * batch_size, epoch=epoch, drop_last=True, shuffle=shuffle, seed=8
            )
            assert dropped == kept
            assert all(all(mask) for _, mask in dropped)


def test_the_last_batch_in_numbers():
    # N = 7, W = 2, B = 2: one process with batch 4 has [0 1 2 3] and [4 5 6 | 0]
    assert one_process(7, 4, shuffle=False) == [
        ([0, 1, 2, 3], [True] * 4),
        ([4, 5, 6, 0], [True, True, True, False]),
    ]
    ranks = [list(x.batches(2)) for x in world(7, 2, shuffle=False)]
    assert [[i.tolist() for i, _ in b] for b in ranks] == [[[0, 2], [4, 6]], [[1, 3], [5, 0]]]
    assert [[m.tolist() for _, m in b] for b in ranks] == [
        [[True, True], [True, True]],
        [[True, True], [True, False]],
    ]


# -- resuming on another world size ---------------------------------------------------------


def run(n, w, batch_size, *, steps=None, state=None, epoch=0, **kwargs):
    """W ranks' batches (interleaved) of one epoch, from `state` on, and the state after
    `steps` of them (the same on every rank)."""
    samplers = world(n, w, **kwargs)
    for sampler in samplers:
        if state is not None:
            sampler.load_state_dict(roundtrip(state))
        sampler.set_epoch(epoch)
    iterators = [x.batches(batch_size) for x in samplers]
    out = []
    for step in itertools.count():
        if steps is not None and step == steps:
            break
        batch = [next(it, None) for it in iterators]
        if batch[0] is None:
            assert all(b is None for b in batch)
            break
        out.append((interleave([i for i, _ in batch]), interleave([m for _, m in batch])))
    states = [x.state_dict() for x in samplers]
    assert all(st == states[0] for st in states)
    return out, states[0]


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("n", [1, 5, 24, 203])
@pytest.mark.parametrize(("w", "w_after"), [(2, 4), (4, 2), (1, 4), (3, 2), (4, 1)])
def test_saved_at_a_batch_boundary_resumes_on_another_world_size(w, w_after, n, shuffle):
    global_batch = 12  # the same global batch before and after: B = 12 / W
    kwargs = {"shuffle": shuffle, "seed": 4, "epoch": 2}
    whole, _ = run(n, w, global_batch // w, **kwargs)
    assert whole == [
        (i, m) for i, m in run(n, 1, global_batch, **kwargs)[0]
    ]  # and that is one process's epoch
    for k in range(len(whole) + 1):
        done, state = run(n, w, global_batch // w, steps=k, **kwargs)
        assert state["position"] == (k * global_batch if k < len(whole) else n)
        rest, end = run(n, w_after, global_batch // w_after, state=state, **kwargs)
        assert done + rest == whole  # exactly the remaining global batches
        assert end["position"] == n


def test_a_resume_with_another_global_batch_skips_and_repeats_nothing():
    _, state = run(203, 4, 3, steps=5, shuffle=True, seed=1)  # position 60
    assert state["position"] == 60
    order = DistributedSampler(203, num_replicas=1, rank=0, seed=1).indices().tolist()
    for w_after, batch_size in [(2, 7), (3, 1), (5, 4), (6, 64)]:
        rest, _ = run(203, w_after, batch_size, state=state, seed=1)
        real = [i for indices, mask in rest for i, m in zip(indices, mask, strict=True) if m]
        assert real == order[60:]
        # the global batches continue at the position: [60, 60 + W'B'), ...
        assert rest[0][0] == (order * 3)[60 : 60 + w_after * batch_size]


@pytest.mark.parametrize("w_after", [1, 2, 3, 4, 7])
def test_position_zero_and_the_end_of_an_epoch_resume_on_any_world_size(w_after):
    start = DistributedSampler(10, num_replicas=2, rank=0, seed=3).state_dict()
    assert start["position"] == 0
    again, _ = run(10, w_after, 2, state=start, seed=3)
    assert again == run(10, w_after, 2, seed=3)[0]
    _, end = run(10, 4, 2, seed=3)  # the whole epoch on 4 ranks: position N
    assert end["position"] == 10
    rest, after = run(10, w_after, 2, state=end, seed=3)
    assert rest == []
    assert after["position"] == 10


def test_drop_last_resumes_where_the_other_world_size_cuts_the_tail():
    # N = 10: 2 ranks keep all 10, 4 ranks keep 8. Saved at 8 on 2 ranks, nothing is left
    # for 4 ranks; saved at 4, they continue with positions 4 to 7.
    _, state = run(10, 2, 1, steps=4, drop_last=True, shuffle=False)
    assert state["position"] == 8
    assert run(10, 4, 1, state=state, drop_last=True, shuffle=False)[0] == []
    _, state = run(10, 2, 1, steps=2, drop_last=True, shuffle=False)
    rest, _ = run(10, 4, 1, state=state, drop_last=True, shuffle=False)
    assert rest == [([4, 5, 6, 7], [True] * 4)]


@pytest.mark.parametrize(("position", "w", "below"), [(6, 4, 4), (2, 3, 0), (203 - 3, 7, 196)])
def test_a_position_this_world_size_cannot_continue_is_a_clear_error(position, w, below):
    state = {**DistributedSampler(203, num_replicas=1, rank=0).state_dict(), "position": position}
    sampler = DistributedSampler(203, num_replicas=w, rank=0)
    match = (
        rf"`state\['position'\]` to be a multiple of `num_replicas={w}`, got {position} "
        rf"instead.*Resume on a number of ranks that divides {position}.*"
        rf"`\{{\*\*state, 'position': {below}\}}` to see {position - below} samples again"
    )
    with pytest.raises(ValueError, match=match):
        sampler.load_state_dict(state)
    sampler.load_state_dict({**state, "position": below})  # the fix the message names
    assert sampler.state_dict()["position"] == below


# -- resuming -------------------------------------------------------------------------------


def roundtrip(state):
    return json.loads(json.dumps(state))


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize(("n", "w"), CASES, ids=[f"N={n}-W={w}" for n, w in CASES])
def test_resume_at_every_batch_continues_with_the_next_batch(n, w, shuffle):
    batch_size = 5
    kwargs = {"seed": 2, "shuffle": shuffle}
    full = []
    for r in range(w):
        sampler = DistributedSampler(n, num_replicas=w, rank=r, **kwargs)
        sampler.set_epoch(4)
        full.append([(i.tolist(), m.tolist()) for i, m in sampler.batches(batch_size)])
    for k in range(len(full[0]) + 1):
        states = []
        for r in range(w):
            first = DistributedSampler(n, num_replicas=w, rank=r, **kwargs)
            first.set_epoch(4)
            batches = first.batches(batch_size)
            done = [next(batches) for _ in range(k)]
            states.append(first.state_dict())  # taken after the step on batch k - 1
            resumed = DistributedSampler(n, num_replicas=w, rank=r, **kwargs)
            resumed.load_state_dict(roundtrip(states[-1]))
            resumed.set_epoch(4)  # the usual loop sets the same epoch again: no reset
            rest = [(i.tolist(), m.tolist()) for i, m in resumed.batches(batch_size)]
            assert [(i.tolist(), m.tolist()) for i, m in done] + rest == full[r]
        assert all(state == states[0] for state in states)  # identical on every rank


@pytest.mark.parametrize(("n", "w"), [(7, 2), (10, 3), (5, 8)])
def test_resume_at_every_sample_of_an_iteration(n, w):
    for r in range(w):
        full = list(DistributedSampler(n, num_replicas=w, rank=r))
        for k in range(len(full) + 1):
            first = DistributedSampler(n, num_replicas=w, rank=r)
            it = iter(first)
            done = [next(it) for _ in range(k)]
            # all ranks together: k * W samples of the global order, N once done
            assert first.state_dict()["position"] == (k * w if k < len(full) else n)
            resumed = DistributedSampler(n, num_replicas=w, rank=r)
            resumed.load_state_dict(first.state_dict())
            assert done + list(resumed) == full


def test_resume_with_another_batch_size_skips_and_repeats_nothing():
    sampler = DistributedSampler(23, num_replicas=2, rank=1, seed=9)
    batches = sampler.batches(4)
    done = [next(batches)[0] for _ in range(2)]
    resumed = DistributedSampler(23, num_replicas=2, rank=1, seed=9)
    resumed.load_state_dict(sampler.state_dict())
    rest = [i[m] for i, m in resumed.batches(3)]
    assert np.concatenate(done + rest).tolist() == sampler.indices()[sampler.mask()].tolist()


def test_epoch_end_and_the_next_epoch():
    sampler = DistributedSampler(10, num_replicas=2, rank=0, seed=1)
    assert sampler.state_dict()["position"] == 0
    assert len(list(sampler.batches(2))) == 3
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == (0, 10)  # N: the epoch is done
    # a state saved at the end of an epoch resumes with nothing left of that epoch
    resumed = DistributedSampler(10, num_replicas=2, rank=0, seed=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    assert list(resumed.batches(2)) == []
    resumed.set_epoch(1)
    assert resumed.state_dict()["position"] == 0
    assert len(list(resumed.batches(2))) == 3
    # a new pass without a loaded state starts the epoch from its beginning
    again = [i.tolist() for i, _ in sampler.batches(2)]
    assert np.concatenate(again)[:5].tolist() == sampler.indices().tolist()


def test_loading_then_setting_a_new_epoch_starts_it_at_zero():
    sampler = DistributedSampler(10, num_replicas=2, rank=0)
    state = {**sampler.state_dict(), "position": 4}
    sampler.load_state_dict(state)
    sampler.set_epoch(1)
    assert len(list(sampler)) == 5


def test_state_contents():
    sampler = DistributedSampler(10, num_replicas=2, rank=1, seed=7, shuffle=False)
    sampler.set_epoch(3)
    assert sampler.state_dict() == {
        "epoch": 3,
        "position": 0,
        "data_size": 10,
        "seed": 7,
        "shuffle": False,
        "drop_last": False,
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"data_size": 11}, r"`data_size=10`.*got `data_size=11`"),
        ({"seed": 8}, r"`seed=7`.*got `seed=8`"),
        ({"shuffle": False}, r"`shuffle=True`.*got `shuffle=False`"),
        ({"drop_last": True}, r"`drop_last=False`.*got `drop_last=True`"),
        ({"position": 11}, r"`state\['position'\]`.*at most the 10 samples.*got 11"),
        (
            {"position": 3},
            (
                r"`state\['position'\]` to be a multiple of `num_replicas=2`, got 3.*after 3 "
                r"samples of epoch 0.*divides 3.*`\{\*\*state, 'position': 2\}` to see 1 samples"
            ),
        ),
        (
            {"num_replicas": 2},
            r"with `num_replicas`.*contiguous block.*load `\{\*\*state, 'position': 0\}`",
        ),
        ({"position": -1}, r"`state\['position'\]`.*got -1"),
        ({"epoch": -2}, r"`state\['epoch'\]`.*got -2"),
    ],
)
def test_load_state_dict_rejects_a_foreign_state(change, match):
    sampler = DistributedSampler(10, num_replicas=2, rank=0, seed=7)
    with pytest.raises(ValueError, match=match):
        sampler.load_state_dict({**sampler.state_dict(), **change})


def test_load_state_dict_accepts_numpy_scalars_from_a_checkpoint():
    sampler = DistributedSampler(10, num_replicas=2, rank=0, seed=7)
    restored = {k: np.asarray(v) for k, v in sampler.state_dict().items()}
    restored["position"] = np.int64(4)
    sampler.load_state_dict(restored)
    assert sampler.state_dict()["position"] == 4
    assert type(sampler.state_dict()["position"]) is int
    with pytest.raises(ValueError, match=r"`shuffle=True`.*got `shuffle=1`"):
        sampler.load_state_dict({**sampler.state_dict(), "shuffle": 1})


def test_load_state_dict_rejects_what_is_not_a_state():
    sampler = DistributedSampler(10, num_replicas=2, rank=0)
    with pytest.raises(TypeError, match="`state`"):
        sampler.load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`state`.*without 'position'"):
        sampler.load_state_dict({"epoch": 0})


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"data": 0}, ValueError, r"`data`.*positive.*got 0"),
        ({"data": -3}, ValueError, r"`data`.*got -3"),
        ({"data": []}, ValueError, r"`data`.*at least one sample.*empty list"),
        ({"data": 7.0}, TypeError, r"`data`.*got 7\.0 of type float"),
        ({"data": "7"}, TypeError, r"`data`.*the string '7'"),
        ({"data": True}, TypeError, r"`data`.*boolean True"),
        ({"data": None}, TypeError, r"`data`.*got None"),
        ({"rank": 2}, ValueError, r"`rank` to be in \[0, 2\).*got 2"),
        ({"rank": -1}, ValueError, r"`rank`.*got -1"),
        ({"num_replicas": 0, "rank": 0}, ValueError, r"`num_replicas`.*positive.*got 0"),
        ({"num_replicas": 2.0}, TypeError, r"`num_replicas`.*got 2\.0 of type float"),
        ({"rank": 1.5}, TypeError, r"`rank`.*got 1\.5"),
        ({"seed": -1}, ValueError, r"`seed`.*got -1"),
        ({"seed": 0.5}, TypeError, r"`seed`.*got 0\.5"),
        ({"shuffle": 1}, TypeError, r"`shuffle`.*True or False.*got 1"),
        ({"drop_last": "no"}, TypeError, r"`drop_last`.*got 'no'"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    arguments = {"data": 10, "num_replicas": 2, "rank": 0, **kwargs}
    with pytest.raises(error, match=match):
        DistributedSampler(**arguments)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s: s.batches(0), ValueError, r"`batch_size` to be a positive integer, got 0"),
        (lambda s: s.batches(-2), ValueError, r"`batch_size`.*got -2"),
        (lambda s: s.batches(2.5), TypeError, r"`batch_size`.*got 2\.5"),
        (lambda s: s.batches(2, drop_last=None), TypeError, r"`drop_last`.*got None"),
        (lambda s: s.num_batches(0), ValueError, r"`batch_size`.*got 0"),
        (lambda s: s.set_epoch(-1), ValueError, r"`epoch`.*got -1"),
        (lambda s: s.set_epoch("1"), TypeError, r"`epoch`.*got '1'"),
    ],
)
def test_bad_method_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call(DistributedSampler(10, num_replicas=2, rank=0))


def test_fewer_samples_than_ranks_is_valid_with_padding():
    samplers = world(3, 8)
    assert [len(x) for x in samplers] == [1] * 8
    assert sum(int(x.mask().sum()) for x in samplers) == 3


def test_default_world_is_one_rank_without_a_launcher():
    sampler = DistributedSampler(7, shuffle=False)
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (1, 0, 7)
    assert sampler.indices().tolist() == list(range(7))
    with pytest.raises(ValueError, match=r"`rank` to be in \[0, 1\)"):
        DistributedSampler(7, rank=1)


def test_repr():
    assert repr(DistributedSampler(7, num_replicas=2, rank=1)) == (
        "DistributedSampler(7, num_replicas=2, rank=1, shuffle=True, seed=0, drop_last=False)"
    )


# -- masked_mean ----------------------------------------------------------------------------


def test_masked_mean_ignores_padding_under_jit():
    values = jnp.array([1.0, 2.0, 3.0, jnp.nan, jnp.inf])
    mask = jnp.array([True, True, True, False, False])
    assert float(jax.jit(jaxddp.masked_mean)(values, mask)) == 2.0
    assert float(jaxddp.masked_mean(values, mask)) == 2.0


def test_masked_mean_broadcasts_over_trailing_axes():
    values = jnp.arange(12.0).reshape(4, 3)
    mask = jnp.array([True, False, True, False])
    out = jax.jit(jaxddp.masked_mean)(values, mask)
    assert out.shape == (3,)
    np.testing.assert_allclose(out, (values[0] + values[2]) / 2)
    full = jaxddp.masked_mean(values, jnp.broadcast_to(mask[:, None], (4, 3)))
    assert full.shape == ()
    assert float(full) == float(jnp.mean(values[jnp.array([0, 2])]))


def test_masked_mean_of_integers_is_float32():
    out = jaxddp.masked_mean(jnp.array([1, 2, 4], jnp.int32), jnp.array([True, True, False]))
    assert out.dtype == jnp.float32
    assert float(out) == 1.5


def test_masked_mean_of_nothing_is_nan():
    out = jax.jit(jaxddp.masked_mean)(jnp.ones(3), jnp.zeros(3, bool))
    assert np.isnan(float(out))


def test_masked_mean_is_the_exact_mean_over_padded_batches_of_every_rank():
    data = np.random.default_rng(0).normal(size=37).astype(np.float32)
    total, count = 0.0, 0
    for sampler in world(37, 4, seed=3):
        for indices, mask in sampler.batches(4):
            # on one rank masked_mean is the local mean; summing by hand plays the allreduce
            local = float(jaxddp.masked_mean(data[indices], mask))
            n = int(mask.sum())
            if n:
                total += local * n
                count += n
    assert count == 37
    np.testing.assert_allclose(total / count, data.mean(), rtol=1e-5)


def test_masked_mean_rejects_bad_masks():
    with pytest.raises(TypeError, match=r"`mask`.*boolean.*float32"):
        jaxddp.masked_mean(jnp.ones(3), jnp.ones(3))
    with pytest.raises(ValueError, match=r"`mask`.*leading shape.*\(3, 2\).*\(2,\)"):
        jaxddp.masked_mean(jnp.ones((3, 2)), jnp.ones(2, bool))


# -- properties -----------------------------------------------------------------------------


CONFIGS = st.fixed_dictionaries(
    {
        "n": st.integers(1, 300),
        "w": st.integers(1, 9),
        "batch_size": st.integers(1, 40),
        "seed": st.integers(0, 2**32 - 1),
        "epoch": st.integers(0, 1000),
        "shuffle": st.booleans(),
    }
)


@settings(max_examples=300)  # no deadline: tests/conftest.py
@given(config=CONFIGS, data=st.data())
def test_properties(config, data):
    n, w, batch_size = config["n"], config["w"], config["batch_size"]
    seed, epoch, shuffle = config["seed"], config["epoch"], config["shuffle"]
    samplers = world(n, w, seed=seed, shuffle=shuffle)
    for sampler in samplers:
        sampler.set_epoch(epoch)
    order, extended, _, _ = reference(n, w, seed=seed, epoch=epoch, shuffle=shuffle)
    s = math.ceil(n / w)
    assert {len(x) for x in samplers} == {s}
    assert interleave([x.indices() for x in samplers]) == extended
    assert sorted(order) == list(range(n))
    batches = [list(x.batches(batch_size)) for x in samplers]
    assert {len(b) for b in batches} == {math.ceil(s / batch_size)}
    kept = []
    for per_rank in batches:
        for indices, mask in per_rank:
            assert indices.shape == mask.shape == (batch_size,)
            kept.extend(indices[mask].tolist())
    assert sorted(kept) == list(range(n))
    # resume every rank at the same random batch
    k = data.draw(st.integers(0, len(batches[0])), label="resume after")
    for sampler, per_rank in zip(samplers, batches, strict=True):
        position = k * batch_size * w if k < len(batches[0]) else n
        state = {**sampler.state_dict(), "position": position}
        resumed = DistributedSampler(
            n, num_replicas=w, rank=sampler.rank, seed=seed, shuffle=shuffle
        )
        resumed.load_state_dict(state)
        rest = [i.tolist() for i, _ in resumed.batches(batch_size)]
        assert rest == [i.tolist() for i, _ in per_rank[k:]]
    # drop_last: floor, no repeats, the same count on every rank
    if n >= w:
        dropped = world(n, w, seed=seed, shuffle=shuffle, drop_last=True)
        for sampler in dropped:
            sampler.set_epoch(epoch)
        assert interleave([x.indices() for x in dropped]) == order[: (n // w) * w]
