"""jaxddp.CheckpointManager on real ranks (2 and 4): one writer, every rank agrees."""

import os
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from mpi4py import MPI

import jaxddp
from tests.mpi.unwritable import make_unwritable

MPI_SIZES = (2, 4)

rank = jaxddp.rank()
size = jaxddp.world_size()
WORLD = MPI.COMM_WORLD


@pytest.fixture
def directory():
    """A fresh directory, the same path on every rank."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="jaxddp-ckpt-") if rank == 0 else None)
    yield os.path.join(path, "checkpoints")
    WORLD.Barrier()


class Net(nnx.Module):
    def __init__(self, rngs):
        self.inner = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)


def _state(seed):
    """A training state whose every value depends on ``seed``."""
    model = Net(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    sampler = jaxddp.DistributedSampler(203, num_replicas=size, rank=rank, seed=seed)
    return {
        "model": nnx.state(model),
        "opt": nnx.state(optimizer),
        "sampler": sampler.state_dict(),
        "step": 100 + seed,
        "key": jax.random.key(seed),
        "numpy": np.arange(4.0) * seed,
    }


def _flat(tree):
    keys = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return [np.asarray(keys(x)) if hasattr(x, "dtype") else x for x in jax.tree.leaves(tree)]


def _assert_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_flat(a), _flat(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_saved_by_one_rank_restored_identical_on_every_rank(directory):
    with jaxddp.CheckpointManager(directory) as ckpt:
        assert ckpt.latest_step() is None
        ckpt.save(1, _state(seed=7))
        ckpt.save(2, _state(seed=10))
        assert ckpt.all_steps() == [1, 2]
        assert ckpt.latest_step() == 2
        restored = ckpt.restore(1, target=_state(seed=50 + rank))  # values: not used
    _assert_equal(restored, _state(seed=7))
    assert isinstance(restored["step"], int)
    assert restored["step"] == 107
    assert jnp.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    assert isinstance(restored["numpy"], np.ndarray)
    assert sorted(os.listdir(directory)) == (
        ["1", "2"] if rank == 0 else sorted(os.listdir(directory))
    )
    everyone = WORLD.allgather(_flat(restored))
    for other in everyone:
        for x, y in zip(other, everyone[0], strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    ("differs", "next_call"),
    [
        ("everything", "wait_until_finished"),
        ("a number", "save"),
        ("one element", "close"),
        ("one element", "blocking"),
    ],
)
def test_a_state_that_differs_between_ranks_is_refused_on_every_rank(directory, differs, next_call):
    # It used to save rank 0's alone, and a restore gave every rank rank 0's values. A
    # background save compares the ranks' copies behind `save`: the manager's next call
    # raises; a blocking one (`background=False`) raises in `save` itself.
    state = _state(seed=3)
    if differs == "everything":
        state = _state(seed=3 + rank)
    elif differs == "a number":
        state["step"] += rank
    elif rank == size - 1:
        state["numpy"][2] += 1.0
    first = {"everything": "['key']", "a number": "['step']", "one element": "['numpy']"}
    others = (
        f"rank {size - 1} holds"
        if differs == "one element" or size == 2
        else ("ranks 1, 2 and 3 hold")
    )
    ckpt = jaxddp.CheckpointManager(directory, background=next_call != "blocking")
    calls = {
        "wait_until_finished": ckpt.wait_until_finished,
        "save": lambda: ckpt.save(2, _state(seed=3)),  # not made: the refusal comes first
        "close": ckpt.close,
    }
    if next_call == "blocking":
        with pytest.raises(ValueError, match=r"^Could not save checkpoint 1 in") as info:
            ckpt.save(1, state)
    else:
        ckpt.save(1, state)  # returns with the copies: they are compared behind it
        with pytest.raises(ValueError, match=r"^Could not save checkpoint 1 in") as info:
            calls[next_call]()
    text = str(info.value)
    assert f"differs between ranks at `{first[differs]}" in text, text
    assert f"{others} other values there than rank 0" in text, text
    assert ("more leaves" in text) == (differs == "everything"), text
    assert "`nnx.state(optimizer)`" in text
    assert WORLD.allgather(text) == [text] * size  # the same error on every rank
    if next_call == "close":
        assert ckpt._manager is None  # released all the same
        ckpt = jaxddp.CheckpointManager(directory)
    assert ckpt.all_steps() == []  # nothing written
    assert WORLD.bcast(os.listdir(directory) if rank == 0 else None) == []  # nor left half
    ckpt.save(1, _state(seed=3))  # the same state on every rank: saved
    assert ckpt.all_steps() == [1]
    ckpt.close()
    assert WORLD.bcast(sorted(os.listdir(directory)) if rank == 0 else None) == ["1"]


def test_restore_none_is_the_newest_and_max_to_keep_drops_the_oldest(directory):
    with jaxddp.CheckpointManager(directory, max_to_keep=2) as ckpt:
        for step in range(4):
            ckpt.save(step, {"w": jnp.full(3, float(step)), "step": step})
        assert ckpt.all_steps() == [2, 3]
        out = ckpt.restore(None, target={"w": jnp.zeros(3), "step": 0})
    np.testing.assert_array_equal(out["w"], np.full(3, 3.0))
    assert out["step"] == 3


@pytest.mark.parametrize("wrong", ["another model", "another shape"])
def test_a_checkpoint_of_another_state_is_a_clear_error_on_every_rank(directory, wrong):
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(5, {"params": nnx.state(nnx.Linear(3, 4, rngs=nnx.Rngs(0)))})
        target = {
            "another model": {
                "params": nnx.state(nnx.Linear(3, 4, use_bias=False, rngs=nnx.Rngs(0)))
            },
            "another shape": {"params": nnx.state(nnx.Linear(3, 5, rngs=nnx.Rngs(0)))},
        }[wrong]
        # named from Orbax's metadata, before any read: a read that fails halfway leaves
        # tensorstore callbacks for a closed event loop ("Event loop is closed" on stderr)
        names = {
            "another model": r"the checkpoint has an entry `\['params'\]\['bias'\]\['value'\]`",
            "another shape": r"holds \(\(4,\), 'float32'\) at `\['params'\]\['bias'\]\['value'\]`, "
            r"but the target has \(\(5,\), 'float32'\)",
        }[wrong]
        with pytest.raises(ValueError, match=f"restore checkpoint 5.*{names}"):
            ckpt.restore(5, target)
        # and the manager still works afterwards, on every rank
        assert ckpt.latest_step() == 5


@pytest.mark.parametrize(
    ("saved", "target", "names"),
    [
        (3, 2.5, r"number of dtype int64 at `\['x'\]`.*Python float \(float64\)"),
        (2.5, 3, r"number of dtype float64 at `\['x'\]`.*Python int \(int64\)"),
        (True, 1, r"number of dtype bool at `\['x'\]`.*Python int \(int64\)"),
        (jnp.arange(3), jnp.zeros(3), r"holds int32 at `\['x'\]`.*target has float32"),
        (jnp.zeros(3), jnp.arange(3), r"holds float32 at `\['x'\]`.*target has int32"),
        (np.int64(4), np.float32(0), r"holds int64 at `\['x'\]`.*target has float32"),
    ],
    ids=["int-as-float", "float-as-int", "bool-as-int", "int-array", "float-array", "numpy"],
)
def test_a_target_of_another_dtype_is_refused_on_every_rank(directory, saved, target, names):
    # Before the fix, a float where an int was saved (a Python number) restored cast.
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, {"x": saved})
        with pytest.raises(ValueError, match=f"restore checkpoint 1.*{names}"):
            ckpt.restore(1, {"x": target})
        assert ckpt.restore(1, {"x": saved})["x"] is not None  # the saved dtype restores


def test_an_unwritable_directory_is_an_error_on_every_rank(directory):
    blocker = WORLD.bcast(tempfile.mkstemp()[1] if rank == 0 else None)
    with pytest.raises(RuntimeError, match=r"open the checkpoint directory") as info:
        jaxddp.CheckpointManager(os.path.join(blocker, "checkpoints"))  # a file's subdirectory
    assert "checkpoints" in str(info.value)


def test_a_failed_save_leaves_every_rank_able_to_go_on_and_exit(directory):
    # Before the fix, a save that failed as the step's folder was made left Orbax's commit
    # threads (not daemons) waiting for a signal, and rank 0 waited for them at exit.
    before = {t.ident for t in threading.enumerate()}
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, {"w": jnp.zeros(3)})
        ckpt.wait_until_finished()  # on disk before the directory is locked
        locked = not make_unwritable(directory, True)
        try:
            if locked:
                ckpt.save(2, {"w": jnp.ones(3)})  # returns: the write fails in the background
                with pytest.raises(RuntimeError, match=r"save checkpoint 2.*(ermission|permitted)"):
                    ckpt.wait_until_finished()
        finally:
            assert make_unwritable(directory, False)
        if not locked:
            pytest.skip("cannot make a directory unwritable here")  # decided on rank 0 for all
        ckpt.save(2, {"w": jnp.ones(3)})  # goes on
        assert ckpt.all_steps() == [1, 2]
        np.testing.assert_array_equal(ckpt.restore(None, {"w": jnp.zeros(3)})["w"], np.ones(3))
    left = [t.name for t in threading.enumerate() if t.ident not in before and not t.daemon]
    assert WORLD.allgather(left) == [[]] * size  # nothing that the exit would wait for


def test_ranks_saving_different_structures_raise_on_every_rank(directory):
    with jaxddp.CheckpointManager(directory) as ckpt:
        state = {"w": jnp.zeros(3)} if rank == 0 else {"w": jnp.zeros(3), "extra": jnp.zeros(1)}
        with pytest.raises(jaxddp.TreeMismatchError):
            ckpt.save(1, state)
        assert ckpt.latest_step() is None


def test_a_missing_step_is_an_error_on_every_rank(directory):
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, {"w": jnp.zeros(2)})
        with pytest.raises(RuntimeError, match="restore checkpoint 7"):
            ckpt.restore(7, {"w": jnp.zeros(2)})
    with (
        jaxddp.CheckpointManager(directory + "-empty") as ckpt,
        pytest.raises(FileNotFoundError, match="no checkpoint"),
    ):
        ckpt.restore(None, {"w": jnp.zeros(2)})


def test_numpy_scalars_come_back_as_numpy_scalars(directory):
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, {"g": np.float32(2.5), "n": np.int64(7), "z": 1 + 2j})
        out = ckpt.restore(1, {"g": np.float32(0), "n": np.int64(0), "z": 0j})
    assert type(out["g"]) is np.float32
    assert out["g"] == 2.5
    assert type(out["n"]) is np.int64
    assert out["n"] == 7
    assert out["z"] == 1 + 2j


def test_an_exception_leaving_the_with_block_on_one_rank_starts_no_collective(directory):
    # Rank 1's exception unwinds through __exit__ while rank 0 is elsewhere (here, a barrier
    # on COMM_WORLD): a collective in __exit__ would leave both waiting forever.
    ckpt = jaxddp.CheckpointManager(directory)
    if rank == 1:
        with pytest.raises(KeyError), ckpt:
            raise KeyError("boom")
    WORLD.Barrier()
    assert rank != 1 or ckpt._manager is None  # released on the rank that raised


@pytest.mark.parametrize("call", ["latest_step", "save"])
def test_a_call_on_rank_0_alone_raises_there_naming_the_call_and_the_others(
    directory, call, monkeypatch
):
    # `if rank == 0: ckpt.latest_step()` returned on rank 0 (its broadcast left unmatched,
    # for another rank's next call to receive); `save` waited in the tree check and raised
    # a TimeoutError naming neither the call nor the ranks.
    with jaxddp.CheckpointManager(directory) as ckpt:
        if rank == 0:
            calls = {"latest_step": ckpt.latest_step, "save": lambda: ckpt.save(1, {"w": 1.0})}
            with monkeypatch.context() as patch:
                patch.setenv("JAXDDP_CHECK_TIMEOUT", "2")  # the wait in vain alone is short
                with pytest.raises(TimeoutError) as info:
                    calls[call]()
            absent = "rank 1, which has" if size == 2 else "ranks 1, 2 and 3, which have"
            assert f"CheckpointManager.{call} waited 2 s on rank 0 for {absent} not called it" in (
                str(info.value)
            )
            assert "not under `if rank == 0:`" in str(info.value)
        WORLD.Barrier()
        assert ckpt.all_steps() == []  # the manager goes on, on every rank


def test_ranks_in_different_calls_raise_on_every_rank(directory):
    with jaxddp.CheckpointManager(directory) as ckpt:
        with pytest.raises(ValueError, match="Expected every rank in the same collective") as info:
            ckpt.save(1, {"w": 1.0}) if rank == 0 else ckpt.latest_step()
        others = "rank 1" if size == 2 else "ranks 1, 2 and 3"
        assert (
            f"rank 0 in CheckpointManager.save; {others} in CheckpointManager.latest_step"
            in str(info.value)
        )
        assert ckpt.all_steps() == []


def test_a_call_without_rank_0_raises_on_the_others_naming_rank_0(directory, monkeypatch):
    comm = WORLD.Dup()  # what the ranks that came sent to rank 0 stays on this one
    ckpt = jaxddp.CheckpointManager(directory, comm=comm)
    monkeypatch.setenv("JAXDDP_CHECK_TIMEOUT", "1")  # the wait in vain alone
    if rank != 0:
        with pytest.raises(
            TimeoutError, match=r"CheckpointManager.all_steps on rank \d+ waited 1 s for rank 0,"
        ):
            ckpt.all_steps()
    WORLD.Barrier()
