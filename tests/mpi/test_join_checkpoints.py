"""The docs' example of checkpoints with `jaxddp.join` (docs/examples/join_checkpoints.py,
docs page "Checkpoints and preemption"): a run stopped mid-epoch and resumed from its
newest checkpoint ends with the uninterrupted run's parameters, bit for bit; the example's
hand-built restore target has the structure of a join's `state_dict()`; and that target
on another number of ranks gets the join's own error. In the 2-rank launch of tests/mpi,
no launch of its own. Every test gathers first and asserts afterwards."""

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from mpi4py import MPI

import jaxddp

MPI_SIZES = (2,)

WORLD, SELF = MPI.COMM_WORLD, MPI.COMM_SELF
rank, size = WORLD.Get_rank(), WORLD.Get_size()

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "join_checkpoints.py"
_spec = importlib.util.spec_from_file_location("join_checkpoints", EXAMPLE)
example = importlib.util.module_from_spec(_spec)
sys.modules["join_checkpoints"] = example
_spec.loader.exec_module(example)


def _shared_folder():
    return WORLD.bcast(tempfile.mkdtemp(prefix="jaxddp-join-ckpt-") if rank == 0 else None)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_run_stopped_mid_epoch_resumes_to_the_uninterrupted_runs_parameters():
    root = _shared_folder()
    whole = example.main(f"{root}/whole")
    # stopped 5 steps after the save of step 8, in the first epoch's streams: the resumed
    # run restores step 8 and replays those 5 steps
    example.main(f"{root}/stopped", stop_after=13)
    with jaxddp.CheckpointManager(f"{root}/stopped") as checkpoints:
        steps = checkpoints.all_steps()
    resumed = example.main(f"{root}/stopped")
    gathered = WORLD.allgather(_leaves(resumed))

    # the resumed run on another number of ranks: each rank alone, its own copy
    mine = shutil.copytree(f"{root}/stopped", f"{root}/alone-{rank}")
    opt_state = example.optimizer().init(whole)
    target = {"params": whole, "opt_state": opt_state, "epoch": 0}
    error = None
    try:
        with jaxddp.CheckpointManager(mine, comm=SELF) as alone:
            alone.restore(alone.latest_step(), {**target, "stream": example.stream_target(1)})
    except ValueError as exc:
        error = str(exc)
    errors = WORLD.allgather(error)
    WORLD.Barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)

    assert steps == [8]
    for a, b in zip(_leaves(whole), _leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit
    for other in gathered:
        for a, b in zip(gathered[0], other, strict=True):
            np.testing.assert_array_equal(a, b)  # the same model on every rank
    for text in errors:
        assert text is not None
        assert f"a state saved on {size} ranks" in text, text
        assert "`['stream']`" in text
        assert f"Resume on {size} ranks, or start the streams anew." in text


def test_the_hand_built_target_has_the_structure_of_a_joins_state():
    """Before the first step, and after the last, when every rank's stream has ended."""
    fresh = jaxddp.join(example.batches(rank, size, 0), batch_size=example.BATCH)
    states = [fresh.state_dict()]
    for _ in fresh:
        pass
    states.append(fresh.state_dict())
    built = example.stream_target(size)

    assert states[1]["steps"] > 0
    for state in states:
        assert jax.tree.structure(built) == jax.tree.structure(state)
        for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(state), strict=True):
            assert type(a) is type(b), (a, b)
