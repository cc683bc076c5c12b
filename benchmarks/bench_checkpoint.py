"""A checkpoint save with jaxddp.CheckpointManager against a single-process Orbax save.

    mpiexec -n 2 python benchmarks/bench_checkpoint.py --out benchmarks/results/checkpoint-np2.json

The state: parameters and Adam's two moments of a model of 24 arrays (3 x 8 MB plus 21
small ones), about 75 MB, with a sampler state and a step counter. ``orbax``: rank 0 alone
saves it with Orbax's own ``CheckpointManager`` (what a single-process job does), the other
ranks waiting in a barrier. ``jaxddp``: every rank calls ``jaxddp.CheckpointManager.save``
(rank 0 writes, the others learn the outcome), blocking. Both wait until the checkpoint is complete
on disk. They take turns; medians. Target: jaxddp at most 1.2x Orbax.
``checksums``: the CRC-32 of every array that jaxddp's save computes (part of ``jaxddp``),
timed alone on rank 0 in the same rounds: the target is at most 10% of the save.
``compare``: the comparison of the ranks' states that the save makes (every rank's
checksums and one small allgather, also part of ``jaxddp``; on the writer its checksums are
the metadata's), timed alone on every rank in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp
import numpy as np

import jaxddp
from jaxddp._collectives import api as _comm
from jaxddp._training.checkpoint import replicated as _replicated
from jaxddp._training.checkpoint import trees as _checkpoint_trees


def make_state() -> dict:
    rng = np.random.default_rng(0)
    params = {f"layer{i}": jnp.asarray(rng.normal(size=(256, 256)), jnp.float32) for i in range(21)}
    params.update(
        {f"big{i}": jnp.asarray(rng.normal(size=(2048, 1024)), jnp.float32) for i in range(3)}
    )
    return {
        "params": params,
        "mu": {k: v * 0.1 for k, v in params.items()},
        "nu": {k: v * v for k, v in params.items()},
        "sampler": {"epoch": 3, "position": 1024, "data_size": 60000, "seed": 0,
                    "shuffle": True, "drop_last": False},
        "step": 1000,
    }  # fmt: skip


def report(result: dict, out: Path | None) -> None:
    """Prints ``result`` without its samples and writes it whole to ``out`` (JSON)."""
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


def main() -> None:
    import orbax.checkpoint as ocp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    comm = _comm.py_comm()
    rank, size = comm.Get_rank(), comm.Get_size()
    state = make_state()
    root = comm.bcast(tempfile.mkdtemp(prefix="jaxddp-bench-ckpt-") if rank == 0 else None)
    ours = jaxddp.CheckpointManager(f"{root}/jaxddp", max_to_keep=2, background=False)
    theirs = None
    if rank == 0:
        options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
        theirs = ocp.CheckpointManager(f"{root}/orbax", options=options)

    def orbax_save(step: int) -> None:
        if theirs is not None:
            theirs.save(step, args=ocp.args.StandardSave(state))
            theirs.wait_until_finished()
        comm.Barrier()

    samples: dict[str, list[float]] = {"orbax": [], "jaxddp": [], "checksums": [], "compare": []}
    storable = _checkpoint_trees.to_storable(state)
    fns = {
        "orbax": orbax_save,
        "jaxddp": lambda step: ours.save(step, state),
        "checksums": lambda step: rank == 0 and _checkpoint_trees.checksums(state),
        "compare": lambda step: _replicated.same_on_every_rank(
            ours._comm, storable, step=step, doing="compare", copy=False
        ),
    }
    for step in range(args.repeats + 1):  # the first round warms up
        names = list(fns) if step % 2 == 0 else list(reversed(fns))
        for name in names:
            comm.Barrier()
            start = time.perf_counter()
            fns[name](step)
            comm.Barrier()
            if step > 0:
                samples[name].append(time.perf_counter() - start)
    ours.close()
    if theirs is not None:
        theirs.close()
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: float(np.median(s)) for name, s in samples.items()}
    nbytes = sum(np.asarray(x).nbytes for x in (*state["params"].values(), *state["mu"].values(),
                                                *state["nu"].values()))  # fmt: skip
    result = {
        "ranks": size,
        "bytes": int(nbytes),
        "orbax_s": medians["orbax"],
        "jaxddp_s": medians["jaxddp"],
        "ratio": medians["jaxddp"] / medians["orbax"],
        "checksums_s": medians["checksums"],
        "checksums_share": medians["checksums"] / medians["jaxddp"],
        "compare_s": medians["compare"],
        "compare_share": medians["compare"] / medians["jaxddp"],
        "samples": samples,
    }
    if rank == 0:
        report(result, args.out)


if __name__ == "__main__":
    main()
