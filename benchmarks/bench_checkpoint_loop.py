"""A training loop that saves every K steps, against the same loop without saves.

    mpiexec -bind-to core -n 2 python benchmarks/bench_checkpoint_loop.py \\
        --out benchmarks/results/checkpoint-loop-np2.json

The state is ``bench_checkpoint.py``'s (parameters and Adam's two moments of 24 arrays, about
92 MB, a sampler state, a step counter). Each step is one jitted function that updates every
array of the state in place (donated, as a training step's optimizer update) and reduces a
scalar across the ranks (jaxddp's allreduce inside ``jax.jit``: the ranks move in lockstep, as
in data-parallel training). Three loops of ``--every`` steps take turns, round after round:
``none`` (no save), ``background`` (``CheckpointManager.save`` at the first step of the
period, the manager's default) and ``blocking`` (``background=False``). Printed: the median
time per step of each, their ratio to ``none``, and the median time ``save`` took to return
in each mode. Targets: the background loop at most 1.05x the loop without saves, and its
``save`` returning in at most 10% of the blocking save's time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import jaxddp
from benchmarks.bench_checkpoint import make_state, make_step, report
from jaxddp._collectives import api as _comm


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--every", type=int, default=100, help="steps between two saves")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    comm = _comm.py_comm()
    rank, size = comm.Get_rank(), comm.Get_size()
    state = jax.tree.map(jnp.asarray, make_state())
    step = make_step()
    for _ in range(3):
        state = step(state)
    jax.block_until_ready(state)
    root = comm.bcast(tempfile.mkdtemp(prefix="jaxddp-bench-loop-") if rank == 0 else None)
    managers = {
        "background": jaxddp.CheckpointManager(f"{root}/background", max_to_keep=2),
        "blocking": jaxddp.CheckpointManager(f"{root}/blocking", max_to_keep=2, background=False),
    }
    per_step: dict[str, list[float]] = {"none": [], "background": [], "blocking": []}
    returns: dict[str, list[float]] = {"background": [], "blocking": []}
    saved = 0
    for r in range(args.rounds + 1):  # the first round warms up
        order = list(per_step) if r % 2 == 0 else list(per_step)[::-1]
        for name in order:
            comm.Barrier()
            start = time.perf_counter()
            for i in range(args.every):
                if i == 0 and name in managers:
                    saved += 1
                    t = time.perf_counter()
                    managers[name].save(saved, state)
                    if r > 0:
                        returns[name].append(time.perf_counter() - t)
                state = step(state)
            jax.block_until_ready(state)
            elapsed = time.perf_counter() - start
            if name == "background":  # the period ends when its write does: count the rest
                t = time.perf_counter()
                managers[name].wait_until_finished()
                elapsed += time.perf_counter() - t
            if r > 0:
                per_step[name].append(elapsed / args.every)
    for manager in managers.values():
        manager.close()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    step_s = {k: float(np.median(v)) for k, v in per_step.items()}
    return_s = {k: float(np.median(v)) for k, v in returns.items()}
    nbytes = sum(x.nbytes for k in ("params", "mu", "nu") for x in jax.tree.leaves(state[k]))
    result = {
        "ranks": size,
        "bytes": int(nbytes),
        "every": args.every,
        "rounds": args.rounds,
        "step_s": step_s,
        "loop_ratio": {k: step_s[k] / step_s["none"] for k in ("background", "blocking")},
        "save_returns_s": return_s,
        "return_share": return_s["background"] / return_s["blocking"],
        "samples": {"per_step": per_step, "returns": returns},
    }
    if rank == 0:
        report(result, args.out)


if __name__ == "__main__":
    main()
