"""jaxddp.join in one process (a world of one): shapes, masks, errors and state.

What needs several ranks (uneven streams, the agreement, errors on every rank, exactness
against one process) is in tests/mpi/test_join.py.
"""

import importlib.util
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxddp


def batches(*sizes, width=2):
    for k, n in enumerate(sizes):
        yield {"x": np.full((n, width), k, np.float32), "i": np.arange(n) + 10 * k}


def test_short_batches_are_padded_with_their_own_rows_to_the_first_batchs_size():
    out = [(b["i"].tolist(), m.tolist()) for b, m in jaxddp.join(batches(4, 3, 1))]
    assert out == [
        ([0, 1, 2, 3], [True] * 4),
        ([10, 11, 12, 10], [True, True, True, False]),
        ([20, 20, 20, 20], [True, False, False, False]),
    ]


def test_an_explicit_batch_size_pads_every_batch_and_an_empty_batch_is_all_padding():
    joined = jaxddp.join(batches(3, 0, 2), batch_size=5)
    out = [(b["x"].shape, m.sum()) for b, m in joined]
    assert out == [((5, 2), 3), ((5, 2), 0), ((5, 2), 2)]
    assert joined.batch_size == 5
    assert joined.steps == 3


def test_empty_first_batches_need_a_batch_size():
    with pytest.raises(ValueError, match="Pass `batch_size`"):
        next(jaxddp.join(batches(0, 2)))
    assert [m.tolist() for _, m in jaxddp.join(batches(0, 2), batch_size=2)] == [
        [False, False],
        [True, True],
    ]


def test_a_batch_larger_than_the_first_is_an_error_naming_its_size():
    joined = jaxddp.join(batches(4, 6))
    next(joined)
    with pytest.raises(ValueError, match=r"at most `batch_size=4` rows .* got 6 rows from rank 0"):
        next(joined)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "8"])
def test_batch_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="Expected `batch_size` to be a positive integer"):
        jaxddp.join(batches(1), batch_size=bad)


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ({"x": np.zeros((2, 3)), "y": np.zeros(3)}, r"same leading \(batch\) axis, got `\['x'\]`"),
        ({"x": np.float32(1.0)}, r"same leading \(batch\) axis"),
        ({}, "at least one array"),
    ],
)
def test_a_batch_without_one_leading_axis_is_refused(item, match):
    with pytest.raises(ValueError, match=match):
        next(jaxddp.join(iter([item])))


def test_masked_pairs_keep_their_mask_and_pad_it_with_false():
    items = [(np.arange(4), np.array([True, False, True, True])), (np.arange(2), np.ones(2, bool))]
    out = [m.tolist() for _, m in jaxddp.join(items, masked=True)]
    assert out == [[True, False, True, True], [True, True, False, False]]
    with pytest.raises(ValueError, match="bool array of shape"):
        next(jaxddp.join([(np.arange(2), np.ones(2))], masked=True))
    with pytest.raises(TypeError, match=r"Expected `\(batch, mask\)` pairs"):
        next(jaxddp.join([np.arange(2)], masked=True))


def test_jax_arrays_stay_jax_arrays_and_the_rest_become_numpy():
    class Rows:  # an array-like that is not a pytree (a tensor of another library)
        def __init__(self, n):
            self.n = n

        def __array__(self, dtype=None, copy=None):
            return np.arange(self.n * 2).reshape(self.n, 2)

    items = [{"a": jnp.ones((3, 2)), "b": Rows(3)}, {"a": jnp.ones((1, 2)), "b": Rows(1)}]
    kinds = [(type(b["a"]), type(b["b"]), b["a"].shape) for b, _ in jaxddp.join(items)]
    assert all(issubclass(a, jax.Array) and b is np.ndarray and s == (3, 2) for a, b, s in kinds)


def test_a_raising_stream_raises_its_own_exception_at_its_step():
    def failing():
        yield from batches(2, 2)
        raise OSError("disk gone")

    joined = jaxddp.join(failing())
    assert len(list(itertools.islice(joined, 2))) == 2  # the batches before it come first
    with pytest.raises(OSError, match="disk gone"):
        next(joined)
    with pytest.raises(StopIteration):  # and the stream is over
        next(joined)


def test_the_step_compiles_once_over_short_batches():
    traces = []

    @jax.jit
    def step(x, mask):
        traces.append(x.shape)
        return jaxddp.masked_mean(x.sum(-1), mask)

    means = [float(step(b["x"], m)) for b, m in jaxddp.join(batches(4, 3, 2, 1, width=3))]
    assert traces == [(4, 3)]
    assert means == [0.0, 3.0, 6.0, 9.0]  # each batch's own rows, padding not counted


def test_state_resumes_the_stream_and_is_refused_where_it_cannot_fit():
    first = jaxddp.join(batches(2, 2, 1))
    next(first)
    state = first.state_dict()
    assert state == {
        "version": 1,
        "world_size": 1,
        "steps": 1,
        "batch_size": 2,
        "ranks": [{"taken": 1, "ended": False}],
    }
    again = jaxddp.join(batches(2, 2, 1))
    again.load_state_dict(state)
    assert [b["i"].tolist() for b, _ in again] == [[10, 11], [20, 20]]
    with pytest.raises(RuntimeError, match="before the first step"):
        again.load_state_dict(state)
    with pytest.raises(ValueError, match="`batch_size=2` as in the saved state"):
        jaxddp.join(batches(2), batch_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="a dict with"):
        jaxddp.join(batches(2)).load_state_dict({"steps": 1})
    short = jaxddp.join(batches(2))
    short.load_state_dict({**state, "ranks": [{"taken": 3, "ended": False}]})
    with pytest.raises(ValueError, match="yield the 3 batches it had handed out"):
        next(short)


def test_a_state_taken_at_the_end_resumes_with_nothing_left():
    joined = jaxddp.join(batches(2, 1))
    assert len(list(joined)) == 2
    state = joined.state_dict()
    again = jaxddp.join(batches(2, 1))
    again.load_state_dict(state)
    assert list(again) == []


needs_grain = pytest.mark.skipif(importlib.util.find_spec("grain") is None, reason="no grain")


@needs_grain
def test_jaxddp_grain_loaders_are_taken_as_masked_pairs():
    import jaxddp.grain

    sampler = jaxddp.DistributedSampler(5, shuffle=False)
    loader = jaxddp.grain.batches(list(range(5)), sampler, 2)
    out = [(b.tolist(), m.tolist()) for b, m in jaxddp.join(loader)]
    assert out == [([0, 1], [True, True]), ([2, 3], [True, True]), ([4, 0], [True, False])]
    options = jaxddp.grain.shard_options(drop_remainder=True)
    assert (options.shard_index, options.shard_count, options.drop_remainder) == (0, 1, True)


def test_each_step_counts_as_progress_for_the_stall_inspector():
    from jaxddp._base import progress as _progress

    before = _progress.count
    assert len(list(jaxddp.join(batches(1, 1, 1)))) == 3
    assert _progress.count - before == 3
    assert _progress.label == "jaxddp.join"


def test_a_stream_that_refills_one_buffer_yields_each_batch_as_it_was_read():
    buffer = np.zeros((2, 3), np.float32)

    def refilling():
        for k in range(5):
            buffer[:] = k
            yield buffer

    out = [b[:, 0].tolist() for b, _ in jaxddp.join(refilling())]
    assert out == [[k, k] for k in range(5)]


def test_a_batch_that_cannot_be_converted_raises_at_its_step_after_the_batches_before_it():
    class DeviceTensor:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("on another device")

    items = [np.zeros((2, 1)), np.ones((2, 1)), DeviceTensor(), np.zeros((2, 1))]
    joined = jaxddp.join(items)
    assert [b[0, 0] for b, _ in itertools.islice(joined, 2)] == [0.0, 1.0]
    with pytest.raises(RuntimeError, match="on another device"):
        next(joined)


def test_a_checkpoint_of_a_join_state_of_other_ranks_names_them_and_nothing_else_does(tmp_path):
    """Through the manager in one process: a join's state as two ranks save it, restored
    into a world of one, names the two ranks; a state that merely has `world_size` and
    `ranks` entries, unlike a join's in count, restores as any other."""
    state = jaxddp.join(batches(2)).state_dict()
    two = {**state, "world_size": 2, "ranks": state["ranks"] * 2}
    other = {"world_size": 4, "ranks": [1, 2, 3]}  # not one entry per rank
    with jaxddp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, {"stream": two, "other": other})
        with pytest.raises(ValueError, match=r"at `\['stream'\]` a state saved on 2 ranks") as e:
            ckpt.restore(1, {"stream": state, "other": other})
        ckpt.save(2, {"other": other})
        assert ckpt.restore(2, {"other": other}) == {"other": other}
    assert "Resume on 2 ranks" in str(e.value)


@needs_grain
def test_a_grain_streams_state_keeps_one_structure_to_its_end_and_restores_through_the_manager(
    tmp_path,
):
    """A state taken after the stream ended holds its state all the same, so a fresh join's
    `state_dict()` is the manager's target for it, at any step."""
    import grain

    dataset = grain.MapDataset.range(6).to_iter_dataset().map(lambda i: {"i": np.int64(i)})
    dataset = dataset.batch(2)
    joined = jaxddp.join(dataset)
    assert len(list(joined)) == 3
    state = joined.state_dict()
    assert state["ranks"][0]["ended"]
    with jaxddp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(3, {"stream": state})
        restored = ckpt.restore(3, {"stream": jaxddp.join(dataset).state_dict()})["stream"]
    again = jaxddp.join(dataset)
    again.load_state_dict(restored)
    assert list(again) == []
    assert again.state_dict() == state
