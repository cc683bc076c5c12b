"""DistributedSampler and masked_mean in one process, for every rank of a world at once.

A sampler with explicit `num_replicas` and `rank` is a pure computation, so every rank's
shard of a world of W ranks can be built here and checked against a literal reference.
"""

import collections
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
    """The issue's definition, literally: (extended order, per-rank blocks, per-rank masks)."""
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
    blocks = [extended[r * s : (r + 1) * s] for r in range(w)]
    masks = [[r * s + i < n for i in range(s)] for r in range(w)]
    return order, extended, blocks, masks


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
        assert indices.tolist() == block  # contiguous blocks of the extended order
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
    everything = np.concatenate([x.indices() for x in samplers]).tolist()
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
        combined = np.concatenate([x.indices() for x in samplers]).tolist()
        # every rank's block is a slice of one and the same order
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
    assert a.indices().tolist() == [8, 9, 0, 1]


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
    s = math.ceil(n / w)
    per_rank = [list(x.batches(batch_size, drop_last=True)) for x in samplers]
    assert [len(b) for b in per_rank] == [s // batch_size] * w
    assert samplers[0].num_batches(batch_size, drop_last=True) == s // batch_size
    for sampler, batches in zip(samplers, per_rank, strict=True):
        flat = np.concatenate([b for b, _ in batches]).tolist()
        assert flat == sampler.indices()[: len(flat)].tolist()


def test_batches_drop_last_with_no_full_batch_is_an_error():
    sampler = DistributedSampler(7, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"`batch_size`.*at most the 4 samples.*got 5"):
        sampler.batches(5, drop_last=True)


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
            assert first.state_dict()["position"] == k
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
    assert (state["epoch"], state["position"]) == (0, 5)
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
    state = {**sampler.state_dict(), "position": 3}
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
        "num_replicas": 2,
        "seed": 7,
        "shuffle": False,
        "drop_last": False,
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"data_size": 11}, r"`data_size=10`.*got `data_size=11`"),
        ({"num_replicas": 3}, r"`num_replicas=2`.*got `num_replicas=3`"),
        ({"seed": 8}, r"`seed=7`.*got `seed=8`"),
        ({"shuffle": False}, r"`shuffle=True`.*got `shuffle=False`"),
        ({"drop_last": True}, r"`drop_last=False`.*got `drop_last=True`"),
        ({"position": 6}, r"`state\['position'\]`.*at most the 5 samples.*got 6"),
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
    restored["position"] = np.int64(3)
    sampler.load_state_dict(restored)
    assert sampler.state_dict()["position"] == 3
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


@settings(max_examples=300, deadline=None)
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
    assert np.concatenate([x.indices() for x in samplers]).tolist() == extended
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
        state = {**sampler.state_dict(), "position": min(k * batch_size, s)}
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
        flat = np.concatenate([x.indices() for x in dropped]).tolist()
        assert flat == order[: (n // w) * w]
