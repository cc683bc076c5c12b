"""The sharded optimizer's slices in a checkpoint, in one process: W writers simulated by
calling ``write`` once per rank, read back at another world size for every rank, damaged,
refused, and the host memory they take. With Orbax, in a world of one: the manager saves a
ShardedState as it is and restores it. On real ranks: tests/mpi/test_checkpoint_slices.py."""

import json
import os
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxddp
from jaxddp._training.checkpoint import slices
from jaxddp._training.checkpoint.trees import to_storable
from jaxddp._training.zero.optimizer import ShardedState, Slicing, _groups, _map_params
from jaxddp._training.zero.slices import layout_of

# odd sizes (no world size divides them), two dtype groups
PARAMS = {
    "w": jnp.linspace(-1, 1, 7 * 13, dtype=jnp.float32).reshape(7, 13),
    "b": jnp.arange(5, dtype=jnp.float32),
    "h": jnp.linspace(-2, 2, 37, dtype=jnp.bfloat16),
}
INNER = optax.adam(1e-2)
STEP = 7


def _full_state():
    """adam's full state after two steps: every moment non-zero."""
    state = INNER.init(PARAMS)
    for k in range(2):
        grads = jax.tree.map(lambda p, k=k: (p + 0.25) * (k + 1), PARAMS)
        _, state = INNER.update(grads, state, PARAMS)
    return state


def _sharded(full, rank, size):
    """Rank ``rank``'s ShardedState of a world of ``size``, cut from ``full`` as
    ``tx.shard_state`` cuts it."""
    layout = layout_of(PARAMS, rank, size)

    def mine(tree):
        return tuple(jnp.asarray(x) for x in layout.mine(layout.pack(jax.tree.leaves(tree))))

    inner = _map_params(INNER, mine, full)
    groups = _groups(INNER, inner, len(layout.groups))
    return ShardedState(inner, Slicing(layout.lengths, size, groups))


def _save(folder, full, size, **kwargs):
    """Every rank's file, written one rank after the other; the description."""
    indices, first = [], None
    for rank in range(size):
        _, pieces = slices.split(to_storable({"opt": _sharded(full, rank, size), "step": 3}))
        indices.append(slices.write(folder, rank, size, pieces, **kwargs))
        first = first or pieces
    return json.loads(json.dumps(slices.describe(indices, first)))  # as the metadata holds it


def _restore(folder, meta, rank, size, **kwargs):
    target = {"opt": _sharded(INNER.init(PARAMS), rank, size), "step": 0}
    tree, wanted = slices.split(to_storable(target))
    arrays = slices.read(folder, meta, wanted, rank=rank, size=size, step=STEP, **kwargs)
    return slices.merge(tree, wanted, arrays)


def _assert_slices_equal(got, want):
    a, b = got.inner[0], want.inner[0]  # adam's ScaleByAdamState: count stays the target's
    for x, y in zip(jax.tree.leaves((a.mu, a.nu)), jax.tree.leaves((b.mu, b.nu)), strict=True):
        assert isinstance(x, jax.Array)
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(("old", "new"), [(2, 3), (4, 2), (3, 1), (3, 4), (1, 2)])
def test_slices_written_at_one_world_size_are_read_at_another(tmp_path, old, new):
    full = _full_state()
    meta = _save(tmp_path, full, old)
    assert meta["world_size"] == old
    assert sorted(os.listdir(tmp_path)) == [f"rank-{r:05d}-of-{old:05d}.bin" for r in range(old)]
    entry = meta["entries"]["opt/inner/0/mu/1"]  # the bfloat16 group of mu
    assert (entry["length"], entry["dtype"], entry["group"]) == (37, "bfloat16", 1)
    assert entry["chunk"] == -(-37 // old)
    restored = [_restore(tmp_path, meta, rank, new) for rank in range(new)]
    for rank, got in enumerate(restored):  # each equals the slice cut from the full state
        _assert_slices_equal(got["opt"], _sharded(full, rank, new))
    # and together they are the full state again
    layout = layout_of(PARAMS, 0, new)
    for which in ("mu", "nu"):
        vectors = [
            jnp.concatenate([getattr(r["opt"].inner[0], which)[g] for r in restored])
            for g in range(2)
        ]
        whole = layout.unpack(vectors)
        for x, y in zip(
            jax.tree.leaves(whole), jax.tree.leaves(getattr(full[0], which)), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_padding_is_not_saved_and_reads_back_as_zeros(tmp_path):
    full = _full_state()
    indices = []
    for rank in range(3):
        state = _sharded(full, rank, 3)
        if rank == 2:  # garbage in the padding (adagrad's initial value would be there)
            state = jax.tree.map(lambda x: x.at[-2:].set(9) if x.shape == (13,) else x, state)
        _, pieces = slices.split(to_storable({"opt": state}))
        indices.append(slices.write(tmp_path, rank, 3, pieces))
    # 91 + 5 = 96 float32 elements: 32 per rank, no padding; 37 bfloat16: 13 per rank, the
    # last rank holding 11 real ones
    counts = {e["path"]: e["count"] for e in indices[2]["entries"]}
    assert counts == {"opt/inner/0/mu/0": 32, "opt/inner/0/mu/1": 11,
                      "opt/inner/0/nu/0": 32, "opt/inner/0/nu/1": 11}  # fmt: skip
    assert (
        indices[2]["bytes"]
        == os.path.getsize(tmp_path / indices[2]["file"])
        == 2 * (32 * 4 + 11 * 2)
    )
    meta = slices.describe(indices, pieces)
    last = _restore(tmp_path, meta, 1, 2)  # 19 bfloat16 elements per rank: 18 real, 1 zero
    assert np.asarray(last["opt"].inner[0].mu[1][-1], np.float32) == 0
    _assert_slices_equal(last["opt"], _sharded(full, 1, 2))


def test_a_state_rebuilt_without_its_slicing_is_refused():
    state = _sharded(_full_state(), 0, 2)
    with pytest.raises(ValueError, match="does not say how it is sliced"):
        slices.split({"opt": ShardedState(state.inner)})


def test_the_optimizer_states_carry_their_slicing_static_and_equal_step_to_step():
    tx = jaxddp.shard_optimizer(INNER)
    state = tx.init(PARAMS)
    assert state.slicing == Slicing((96, 37), 1, (-1, 0, 1, 0, 1))  # count, mu, nu
    traces = []

    @jax.jit
    def step(state, grads):
        traces.append(1)
        return tx.update(grads, state, PARAMS)[1]

    for _ in range(3):
        state = step(state, PARAMS)
    assert len(traces) == 1
    assert state.slicing == tx.init(PARAMS).slicing
    assert jax.tree.structure(state) == jax.tree.structure(tx.init(PARAMS))


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "byte":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["byte", "truncated", "missing"])
def test_a_damaged_file_is_a_damaged_checkpoint_naming_step_file_and_entry(tmp_path, how):
    meta = _save(tmp_path, _full_state(), 2)
    path = tmp_path / "rank-00001-of-00002.bin"
    if how == "missing":
        path.unlink()
    else:
        _damage(path, how)
    says = {"byte": "fails the checksum", "truncated": "is cut short", "missing": "cannot be read"}
    pattern = rf"Checkpoint {STEP} is damaged: .*`opt/inner/0/\w+/\d` in rank-00001-of-00002\.bin"
    with pytest.raises(jaxddp.DamagedCheckpointError, match=pattern) as info:
        _restore(tmp_path, meta, 0, 1)  # one rank reads everything
    assert says[how] in str(info.value)


def test_a_target_of_another_state_is_refused_naming_the_entry_and_both_values(tmp_path):
    meta = _save(tmp_path, _full_state(), 2)
    _, wanted = slices.split(to_storable({"opt": _sharded(INNER.init(PARAMS), 0, 3), "step": 0}))
    longer = [*wanted[:1], slices.Piece(**{**vars(wanted[1]), "length": 38}), *wanted[2:]]
    with pytest.raises(ValueError, match=r"`opt/inner/0/mu/1` with elements 37.*target has.* 38"):
        slices.read(tmp_path, meta, longer, rank=0, size=3, step=STEP)
    wider = [slices.Piece(**{**vars(wanted[0]), "dtype": np.dtype(np.float64)}), *wanted[1:]]
    with pytest.raises(ValueError, match=r"`opt/inner/0/mu/0` with dtype float32.*float64"):
        slices.read(tmp_path, meta, wider, rank=0, size=3, step=STEP)
    with pytest.raises(ValueError, match=r"the checkpoint has .* `opt/inner/0/nu/1` that the tar"):
        slices.read(tmp_path, meta, wanted[:3], rank=0, size=3, step=STEP)


def test_host_memory_is_one_slice_and_one_buffer_not_the_whole_state(tmp_path):
    n, size, buffer = 1_000_003, 4, 1 << 18  # 4 MB of float32 per copy, 1 MB per rank
    vector = np.arange(n, dtype=np.float32)
    chunk = -(-n // size)
    padded = np.concatenate([vector, np.zeros(chunk * size - n, np.float32)])

    def pieces(rank):
        array = padded[rank * chunk : (rank + 1) * chunk].copy()
        return [slices.Piece("v", 0, np.dtype(np.float32), n, size, array)]

    indices, peaks = [], []
    for rank in range(size):
        mine = pieces(rank)
        tracemalloc.start()
        indices.append(slices.write(tmp_path, rank, size, mine, buffer_bytes=buffer))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert max(peaks) < buffer + (64 << 10)  # the slice is written from where it lies
    meta = slices.describe(indices, pieces(0))
    new = 3
    wanted = [slices.Piece("v", 0, np.dtype(np.float32), n, new, np.zeros(0, np.float32))]
    slice_bytes = -(-n // new) * 4
    for rank in range(new):
        tracemalloc.start()
        (got,) = slices.read(
            tmp_path, meta, wanted, rank=rank, size=new, step=STEP, buffer_bytes=buffer
        )
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < slice_bytes + buffer + (64 << 10) < n * 4  # not the whole vector
        lo = rank * got.size
        np.testing.assert_array_equal(got[: max(0, n - lo)], vector[lo : lo + got.size])


# -- with Orbax, in a world of one --------------------------------------------------------------


def test_the_manager_saves_a_sharded_state_as_it_is_and_restores_it(tmp_path):
    tx = jaxddp.shard_optimizer(INNER)
    state = tx.init(PARAMS)
    for k in range(2):
        _, state = tx.update(jax.tree.map(lambda p, k=k: p * (k + 2), PARAMS), state, PARAMS)
    with jaxddp.CheckpointManager(tmp_path, max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"params": PARAMS, "opt": state})
        assert ckpt.all_steps() == [2, 3]
        restored = ckpt.restore(None, {"params": PARAMS, "opt": tx.init(PARAMS)})
        written = (tmp_path / "3.slices" / "rank-00000-of-00001.bin").read_bytes()
        with pytest.raises(RuntimeError, match="checkpoint 3 exists already"):  # kept as it is
            ckpt.save(3, {"params": PARAMS, "opt": tx.init(PARAMS)})
        assert (tmp_path / "3.slices" / "rank-00000-of-00001.bin").read_bytes() == written
    # the slices of step 1 went with it, and no temporary folder stays
    assert sorted(os.listdir(tmp_path)) == ["2", "2.slices", "3", "3.slices"]
    assert os.listdir(tmp_path / "3.slices") == ["rank-00000-of-00001.bin"]
    assert restored["opt"].slicing == state.slicing
    assert int(restored["opt"].inner[0].count) == 2
    _assert_slices_equal(restored["opt"], state)
    # a damaged slice: the resume falls back to the older checkpoint, with a warning
    _damage(tmp_path / "3.slices" / "rank-00000-of-00001.bin", "byte")
    with jaxddp.CheckpointManager(tmp_path) as ckpt:
        with pytest.warns(RuntimeWarning, match=r"Checkpoint 3 is damaged: .*rank-00000-of-00001"):
            restored = ckpt.restore(None, {"params": PARAMS, "opt": tx.init(PARAMS)})
        _assert_slices_equal(restored["opt"], state)
        with pytest.raises(jaxddp.DamagedCheckpointError, match="Checkpoint 3 is damaged"):
            ckpt.restore(3, {"params": PARAMS, "opt": tx.init(PARAMS)})
        with pytest.warns(RuntimeWarning, match="moved aside"):  # saved anew, slices too
            ckpt.save(3, {"params": PARAMS, "opt": state})
        _assert_slices_equal(
            ckpt.restore(3, {"params": PARAMS, "opt": tx.init(PARAMS)})["opt"], state
        )
    assert {"3.damaged", "3.damaged.slices"} <= set(os.listdir(tmp_path))


def test_what_a_save_cut_short_leaves_is_never_listed_and_the_next_save_removes_it(tmp_path):
    # a kill while the ranks wrote (a .tmp folder), or between the rename and Orbax's commit
    # (slices of a step Orbax does not list)
    tx = jaxddp.shard_optimizer(INNER)
    with jaxddp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, {"opt": tx.init(PARAMS)})
        for name in ("2.slices.tmp", "3.slices"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "rank-00000-of-00001.bin").write_bytes(b"half")
        assert ckpt.all_steps() == [1]
        ckpt.save(3, {"opt": tx.init(PARAMS)})  # the orphan of step 3 replaced
        assert ckpt.all_steps() == [1, 3]
        _assert_slices_equal(ckpt.restore(3, {"opt": tx.init(PARAMS)})["opt"], tx.init(PARAMS))
    assert sorted(os.listdir(tmp_path)) == ["1", "1.slices", "3", "3.slices"]
