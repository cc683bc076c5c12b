"""jaxddp.join on real ranks (2, 3 and 4): per-rank streams of different lengths.

Every rank reads a stream of its own (the number of batches and their sizes depend on the
rank; the last rank's is empty in the `empty` cases); join must give every rank the same
number of fixed-shape steps and train exactly what one process trains on the real samples
of every rank's k-th batch together. Every test gathers what it needs with collectives
first and asserts afterwards, so that a failing assertion never leaves the other ranks
waiting in a collective.
"""

import functools
import importlib.util
import itertools
import json
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from mpi4py import MPI

import jaxddp

MPI_SIZES = (2, 3, 4)
# Once more at 2 ranks as on a GPU: the ordered path, and every jitted collective through
# the handlers of GPU programs, their host side run on the CPU against the stand-in CUDA
# driver (tests/native/driver.c).
MPI_VARIANTS = {
    "staged": {
        "JAXDDP_TEST_STAGED": "1",
        "JAXDDP_TEST_CUDA_DRIVER": "<stand-in CUDA driver>",
        "JAXDDP_TEST_COLLECTIVE_PATH": "ordered",
    }
}
MPI_VARIANT_SIZES = {"staged": (2,)}

rank = jaxddp.rank()
size = jaxddp.world_size()
WORLD, SELF = MPI.COMM_WORLD, MPI.COMM_SELF
B, FEATURES = 8, 5

# The rows of each rank's batches: rank 1 reads longest, rank 2 nothing, rank 3 one batch.
LENGTHS = {0: [8, 8, 5], 1: [8, 8, 8, 8, 3, 8, 6], 2: [], 3: [4]}


def lengths(r, empty_last):
    """Rank r's batch sizes; with ``empty_last`` the last rank's stream is empty."""
    return [] if empty_last and r == size - 1 else LENGTHS[r]


def rank_batches(r, empty_last=False):
    """Rank r's stream, as a list: features, targets and each row's global id."""
    out = []
    for k, n in enumerate(lengths(r, empty_last)):
        rng = np.random.default_rng([r, k])
        x = (rng.normal(size=(n, FEATURES)) * 2 + 0.5).astype(np.float32)
        y = rng.normal(size=(n, 1)).astype(np.float32)
        ids = np.arange(n, dtype=np.int32) + 1000 * r + 100 * k
        out.append({"x": x, "y": y, "id": ids})
    return out


def stream(r=rank, empty_last=False):
    yield from rank_batches(r, empty_last)


STEPS = {e: max(len(lengths(r, e)) for r in range(size)) for e in (False, True)}


@pytest.mark.parametrize("empty_last", [False, True], ids=["all-read", "empty"])
def test_every_rank_takes_the_same_steps_with_its_own_samples(empty_last):
    seen = [
        (batch["id"].copy(), mask.copy()) for batch, mask in jaxddp.join(stream(rank, empty_last))
    ]
    shapes = {ids.shape for ids, _ in seen}
    real = [ids[mask].tolist() for ids, mask in seen]
    steps = WORLD.allgather(len(seen))

    assert steps == [STEPS[empty_last]] * size  # the longest stream's count, on every rank
    assert shapes == {(B,)}  # every batch padded to the largest first batch
    mine = [b["id"].tolist() for b in rank_batches(rank, empty_last)]
    assert real[: len(mine)] == mine  # the real rows are the stream's, in order
    assert all(r == [] for r in real[len(mine) :])  # then padding only
    for ids, mask in seen[: len(mine)]:  # short batches padded with their own rows
        assert set(ids[~mask].tolist()) <= set(ids[mask].tolist())


# ---- exact: one process on the real samples of every rank's k-th batch ---------------------


class NormNet(nnx.Module):
    def __init__(self, norm, rngs):
        self.inner = nnx.Linear(FEATURES, 8, use_bias=False, rngs=rngs)
        self.norm = norm(8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, mask):
        return self.head(jax.nn.relu(self.norm(self.inner(x), mask=mask[:, None])))


def _loss(model, x, y, mask, comm):
    return jaxddp.masked_mean(jnp.sum((model(x, mask) - y) ** 2, -1), mask, comm=comm)


def _trainer(norm, comm):
    model = NormNet(norm, nnx.Rngs(0))
    tx = optax.chain(jaxddp.allreduce_gradients(comm=comm), optax.adam(1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    traces = []

    @nnx.jit
    def step(model, optimizer, x, y, mask):
        traces.append(x.shape)
        loss, grads = nnx.value_and_grad(_loss)(model, x, y, mask, comm)
        optimizer.update(model, grads)
        return loss

    return model, functools.partial(step, model, optimizer), traces


def test_join_trains_as_one_process_on_every_ranks_kth_batch():
    """SyncBatchNorm and masked_mean, an empty last rank, short batches, padding-only
    ranks: the parameters and batch statistics one process reaches, to 1e-6."""
    model, step, traces = _trainer(jaxddp.SyncBatchNorm, None)
    losses = []
    for batch, mask in jaxddp.join(stream(rank, True)):
        losses.append(float(step(batch["x"], batch["y"], mask)))
    state = nnx.state(model)

    one, one_step, _ = _trainer(nnx.BatchNorm, SELF)  # every rank runs the reference itself
    everyone = [rank_batches(r, True) for r in range(size)]
    one_losses = []
    for k in range(STEPS[True]):
        parts = [b[k] for b in everyone if k < len(b)]
        x = np.concatenate([p["x"] for p in parts])
        y = np.concatenate([p["y"] for p in parts])
        one_losses.append(float(one_step(x, y, np.ones(len(x), bool))))
    gathered = WORLD.allgather([np.asarray(v) for v in jax.tree.leaves(state)])

    assert traces == [(B, FEATURES)]  # compiled once: every yielded batch has one shape
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(nnx.state(one)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    for other in gathered:  # and the same model on every rank
        for a, b in zip(gathered[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


# ---- errors on every rank -----------------------------------------------------------------


def _outcome(batches, **kwargs):
    """The steps taken and the error raised (type name, text), gathered from every rank."""
    steps, error = 0, None
    try:
        for _ in jaxddp.join(batches, **kwargs):
            steps += 1
    except Exception as exc:  # noqa: BLE001 - any error, gathered from every rank
        error = (type(exc).__name__, str(exc))
    return WORLD.allgather((steps, error))


def test_ranks_whose_batches_differ_get_a_tree_mismatch_error_before_a_step():
    odd = 1  # a rank with data (rank 2 has none)

    def batches():
        for b in rank_batches(rank):
            yield {**b, "x": b["x"].astype(np.float64)} if rank == odd else b

    everyone = _outcome(batches())
    assert {steps for steps, _ in everyone} == {0}  # no step ran on any rank
    kinds = {error[0] for _, error in everyone}
    assert kinds == {"TreeMismatchError"}
    text = everyone[0][1][1]
    assert f"rank {odd}'s batch has float64[*,{FEATURES}] at `['x']`" in text
    assert f"rank 0's has float32[*,{FEATURES}]" in text
    assert len({error for _, error in everyone}) == 1  # the same message on every rank


def test_a_later_batch_of_another_structure_raises_on_every_rank_at_its_step():
    def batches():
        for k, b in enumerate(rank_batches(1 if rank == 1 else 0)):
            yield {**b, "x": b["x"][:, :3]} if rank == 1 and k == 2 else b

    everyone = _outcome(batches())
    assert {steps for steps, _ in everyone} == {2}  # batches 1 and 2 ran everywhere
    assert {error[0] for _, error in everyone} == {"TreeMismatchError"}
    assert "Batch 3 of `jaxddp.join`" in everyone[0][1][1]
    assert "rank 1's batch has float32[*,3] at `['x']`" in everyone[0][1][1]


def test_a_batch_larger_than_batch_size_raises_on_every_rank():
    everyone = _outcome(stream(1 if rank == 1 else 3), batch_size=6)
    assert {error[0] for _, error in everyone} == {"ValueError"}
    assert "got 8 rows from rank 1" in everyone[0][1][1]
    assert {steps for steps, _ in everyone} == {0}


def test_a_raising_stream_raises_on_every_rank_at_its_step():
    def batches():
        for k, b in enumerate(rank_batches(1)):
            if rank == size - 1 and k == 2:
                raise OSError("disk gone")
            yield b

    everyone = _outcome(batches())
    assert {steps for steps, _ in everyone} == {2}
    assert everyone[size - 1][1] == ("OSError", "disk gone")  # its own exception
    for _, (kind, text) in everyone[: size - 1]:
        assert kind == "RuntimeError"
        assert f"Rank {size - 1}'s stream raised OSError: disk gone (at step 3" in text


def test_a_loop_left_early_on_every_rank_leaves_the_next_join_working():
    """Bytes still in flight when every rank breaks out are matched in order: the next
    join on the same ranks agrees as if nothing had been left."""
    for k, _ in enumerate(jaxddp.join(stream(rank))):
        if k == 1:
            break
    out = [b["id"][m].tolist() for b, m in jaxddp.join(stream(rank))]
    steps = WORLD.allgather(len(out))
    assert steps == [STEPS[False]] * size
    assert [i for ids in out for i in ids] == [i for b in rank_batches(rank) for i in b["id"]]


# ---- state -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [1, 2, 5])
def test_a_state_taken_mid_stream_resumes_the_same_steps(stop):
    """Streams without a state of their own are read again and skipped to where they were;
    the state goes through JSON as a checkpoint's would. (Padding rows, never counted, may
    hold other rows after a resume: compared are the real rows and the masks.)"""

    def seen(joined):
        return [(b["id"][m].tolist(), m.tolist()) for b, m in joined]

    whole = seen(jaxddp.join(stream(rank, True)))
    stop = min(stop, len(whole) - 1)
    first = jaxddp.join(stream(rank, True))
    head = seen(itertools.islice(first, stop))
    state = json.loads(json.dumps(first.state_dict()))
    again = jaxddp.join(stream(rank, True))
    again.load_state_dict(state)
    tail = seen(again)
    states = WORLD.allgather(state)

    assert head + tail == whole
    assert again.steps == len(whole)
    assert all(s == states[0] for s in states)  # identical on every rank: rank 0 saves it
    assert state["steps"] == stop
    assert state["world_size"] == size


def test_a_state_from_another_world_size_is_refused():
    state = jaxddp.join(stream()).state_dict()
    state = {**state, "world_size": size + 1, "ranks": state["ranks"] + state["ranks"][:1]}
    with pytest.raises(ValueError, match=r"saved on .* ranks instead: each rank's stream"):
        jaxddp.join(stream()).load_state_dict(state)


# ---- grain and PyTorch streams ------------------------------------------------------------

needs_grain = pytest.mark.skipif(importlib.util.find_spec("grain") is None, reason="no grain")


@needs_grain
def test_grain_iter_datasets_sharded_and_filtered_per_rank_resume_from_their_state():
    import grain

    import jaxddp.grain

    options = jaxddp.grain.shard_options()
    records = grain.MapDataset.range(203)[options.shard_index :: options.shard_count]
    kept = records.to_iter_dataset().filter(lambda i: (i // size) % (rank + 2) != 0)
    dataset = kept.map(lambda i: {"i": np.int64(i)}).batch(B)

    whole = [b["i"][m].tolist() for b, m in jaxddp.join(dataset)]
    first = jaxddp.join(dataset)
    head = [b["i"][m].tolist() for b, m in itertools.islice(first, 3)]
    state = first.state_dict()
    again = jaxddp.join(dataset)
    again.load_state_dict(state)
    tail = [b["i"][m].tolist() for b, m in again]
    everyone = WORLD.allgather(sorted(i for batch in whole for i in batch))

    assert head + tail == whole
    assert "stream" in state["ranks"][0]  # grain's own state, not a replay
    assert all("stream" in r for r in state["ranks"])
    expected = [i for i in range(203) if (i // size) % (i % size + 2) != 0]
    assert sorted(i for mine in everyone for i in mine) == expected  # each sample once


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch")


@needs_torch
def test_a_torch_iterable_dataset_through_a_dataloader_on_each_rank():
    import torch

    class Shard(torch.utils.data.IterableDataset):
        def __iter__(self):
            for b in rank_batches(rank, True):
                yield from (
                    {"x": torch.from_numpy(x), "id": int(i)}
                    for x, i in zip(b["x"], b["id"], strict=True)
                )

    loader = torch.utils.data.DataLoader(Shard(), batch_size=B)
    seen = [(b["id"][m].tolist(), type(b["x"]).__name__) for b, m in jaxddp.join(loader)]
    steps = WORLD.allgather(len(seen))
    mine = [i for b in rank_batches(rank, True) for i in b["id"].tolist()]

    assert [i for ids, _ in seen for i in ids] == mine
    assert {kind for _, kind in seen} <= {"ndarray"}  # torch tensors become NumPy arrays
    assert len(set(steps)) == 1


# ---- the docs' example -----------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "uneven_streams.py"


def test_the_docs_example_trains_exactly():
    spec = importlib.util.spec_from_file_location("uneven_streams", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules["uneven_streams"] = example
    spec.loader.exec_module(example)
    params = example.main()
    reference = example.one_process(size)
    gathered = WORLD.allgather([np.asarray(v) for v in jax.tree.leaves(params)])
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    for other in gathered:
        for a, b in zip(gathered[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


# ---- what a stream, a step or a rank may do to a join ----------------------------------------


def test_a_stream_that_refills_one_buffer_yields_every_batch_as_read():
    """A reader that refills one buffer and yields it (or views of it) each time: join reads
    ahead, so it must own what it holds, or later reads overwrite the batches it hands out."""
    x, ids = np.zeros((B, FEATURES), np.float32), np.zeros(B, np.int32)

    def refilling():
        for b in rank_batches(rank):
            n = len(b["id"])
            x[:n], ids[:n] = b["x"], b["id"]
            yield {"x": x if n == B else x[:n], "y": b["y"], "id": ids if n == B else ids[:n]}

    seen = [(b["id"][m].tolist(), b["x"][m].tolist()) for b, m in jaxddp.join(refilling())]
    steps = WORLD.allgather(len(seen))

    assert steps == [STEPS[False]] * size
    mine = rank_batches(rank)
    assert [ids for ids, _ in seen[: len(mine)]] == [b["id"].tolist() for b in mine]
    assert [rows for _, rows in seen[: len(mine)]] == [b["x"].tolist() for b in mine]
    assert all(ids == [] for ids, _ in seen[len(mine) :])


@pytest.fixture(params=["direct", "allgather"])
def wire_path(request, monkeypatch):
    """Both ways a step's bytes travel: straight to every rank, or MPI's allgather (above
    16 ranks; here at any size)."""
    from jaxddp._data.join import wire

    monkeypatch.setattr(wire, "DIRECT_RANKS", 16 if request.param == "direct" else 1)
    return request.param


def test_a_join_left_on_different_steps_leaves_the_next_join_clean(wire_path):
    """Rank r leaves the first join after r + 1 steps: its bytes in flight and the other
    ranks' differ in number. The next join must take its own bytes only."""
    for k, _ in enumerate(jaxddp.join(stream(rank))):
        if k == rank:
            break
    out = [b["id"][m].tolist() for b, m in jaxddp.join(stream(rank))]
    steps = WORLD.allgather(len(out))

    assert steps == [STEPS[False]] * size
    assert [i for ids in out for i in ids] == [i for b in rank_batches(rank) for i in b["id"]]


@pytest.mark.parametrize("how", ["dropped", "close"])
def test_the_ranks_that_go_on_after_rank_0_left_get_an_error_naming_it(wire_path, how):
    """Rank 0 leaves after one step: it drops the join (as a `break` out of
    `for ... in jaxddp.join(...)` does) or closes it; the others iterate on. Rank 0's bytes
    end three steps later: there the others raise, instead of waiting forever."""
    steps, error = 0, None
    joined = jaxddp.join(stream(1))  # 7 batches on every rank
    try:
        for _ in joined:
            steps += 1
            if rank == 0:
                break
    except RuntimeError as exc:
        error = str(exc)
    if rank == 0 and how == "close":
        joined.close()
    del joined
    everyone = WORLD.allgather((steps, error))

    assert everyone[0] == (1, None)
    for steps, error in everyone[1:]:
        assert steps == 4  # rank 0 had posted its bytes of steps 2-4 before it left
        assert "Rank 0 left this `jaxddp.join` after step 1" in error
        assert "at step 5" in error


def test_state_dict_on_one_rank_alone_raises_naming_the_call_and_the_ranks_absent(monkeypatch):
    """`state_dict()` under `if rank == 0:` (a save on the writing rank alone): rank 0 gets
    an error naming the call and the others within the check's limit, not a spin in MPI;
    the join goes on, and a state taken on every rank afterwards is right."""
    joined = jaxddp.join(stream(rank))
    next(joined)
    error = None
    if rank == 0:
        with monkeypatch.context() as patch:  # the wait in vain alone is short
            patch.setenv("JAXDDP_CHECK_TIMEOUT", "1")
            try:
                joined.state_dict()
            except TimeoutError as exc:
                error = str(exc)
    errors = WORLD.allgather(error)
    state = joined.state_dict()  # on every rank: what rank 0 sent above is not taken for it
    rest = len(list(joined))
    everyone = WORLD.allgather((state, rest))

    assert errors[1:] == [None] * (size - 1)
    absent = ("rank " if size == 2 else "ranks ") + ", ".join(map(str, range(1, size)))
    assert f"`state_dict()` of `jaxddp.join` on rank 0 waited 1 s for {absent}," in errors[0]
    assert "not under `if rank == 0:`" in errors[0]
    assert all(s == everyone[0][0] for s, _ in everyone)
    assert state["steps"] == 1
    assert {r for _, r in everyone} == {STEPS[False] - 1}


class _DeviceTensor:
    """A leaf that cannot become a NumPy array (a tensor on another device)."""

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("cannot convert a device tensor")


def test_a_batch_that_cannot_be_converted_raises_on_every_rank_at_its_step():
    seen, error = [], None

    def batches():
        for k, b in enumerate(rank_batches(1)):
            yield {**b, "x": _DeviceTensor()} if rank == size - 1 and k == 2 else b

    try:
        for b, m in jaxddp.join(batches()):
            seen.append(b["id"][m].tolist())
    except Exception as exc:  # noqa: BLE001 - any error, gathered from every rank
        error = (type(exc).__name__, str(exc))
    everyone = WORLD.allgather((seen, error))

    for r, (got, _) in enumerate(everyone):
        assert got == [b["id"].tolist() for b in rank_batches(1)[:2]], r  # no batch lost
    assert everyone[size - 1][1] == ("RuntimeError", "cannot convert a device tensor")
    for _, (kind, text) in everyone[: size - 1]:
        assert kind == "RuntimeError"
        assert f"Rank {size - 1}'s batch 3 could not be read: RuntimeError: cannot" in text
        assert "at step 3 of `jaxddp.join`" in text


def test_a_step_that_donates_its_batch_gets_fresh_padding_at_every_step():
    """The ranks whose stream ends first yield padding while the others train: a jitted
    step that donates its batch must never meet an array it already donated."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(x, mask):
        return x * mask[:, None]

    def batches():
        for b in rank_batches(rank):  # rank 0's ends after 3 batches, rank 1's after 7
            yield {"x": jnp.asarray(b["x"]), "id": b["id"]}

    steps, error = 0, None
    try:
        for batch, mask in jaxddp.join(batches()):
            step(batch["x"], mask).block_until_ready()
            steps += 1
    except Exception as exc:  # noqa: BLE001 - any error, gathered from every rank
        error = f"{type(exc).__name__}: {exc}"
    everyone = WORLD.allgather((steps, error))

    assert everyone == [(STEPS[False], None)] * size


def test_a_join_state_restored_on_another_number_of_ranks_names_them():
    """A checkpoint holding a join's state, saved on every rank of the world, restored by a
    manager of one rank (each rank alone): the join's own message, not another model's."""
    directory = WORLD.bcast(tempfile.mkdtemp(prefix="jaxddp-join-") if rank == 0 else None)
    joined = jaxddp.join(stream(rank))
    next(joined)
    with jaxddp.CheckpointManager(directory) as ckpt:
        ckpt.save(1, {"step": 1, "stream": joined.state_dict()})
    error = None
    alone = {"step": 0, "stream": jaxddp.join(stream(rank), comm=SELF).state_dict()}
    mine = shutil.copytree(directory, f"{directory}-{rank}")  # each rank reads its own copy
    try:
        with jaxddp.CheckpointManager(mine, comm=SELF) as ckpt:
            ckpt.restore(1, alone)
    except ValueError as exc:
        error = str(exc)
    errors = WORLD.allgather(error)
    shutil.rmtree(mine, ignore_errors=True)
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)

    for error in errors:
        assert f"saved on {size} ranks" in error
        assert "`['stream']`" in error
        assert f"Resume on {size} ranks" in error


def test_state_dict_at_different_steps_raises_on_every_rank(monkeypatch):
    """Rank 0 takes the state after one step, the others after two: the ranks behind learn
    it from the others' calls (a ValueError), the ranks ahead wait for rank 0's in vain."""
    # Only the waits in vain are short: rank 0's ends when the others' calls come, however
    # late a loaded machine makes them.
    monkeypatch.setenv("JAXDDP_CHECK_TIMEOUT", "60" if rank == 0 else "1")
    joined = jaxddp.join(stream(1))
    next(joined)
    if rank > 0:
        next(joined)
    error = None
    try:
        joined.state_dict()
    except (ValueError, TimeoutError) as exc:
        error = (type(exc).__name__, str(exc))
    del joined
    everyone = WORLD.allgather(error)

    kind, text = everyone[0]
    assert kind == "ValueError"
    assert "Expected every rank to call `state_dict()` of `jaxddp.join` at the same step" in text
    assert "and rank 0 at step 1 of join number" in text
    for kind, text in everyone[1:]:
        assert kind == "TimeoutError"
        assert "for rank 0, which did not call it" in text
