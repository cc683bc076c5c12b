"""The sharded optimizer's checkpoint: saved slice by slice against gathered, time and memory.

    mpiexec -bind-to core -n 2 python benchmarks/bench_sharded_checkpoint.py \\
        --out benchmarks/results/sharded-checkpoint-np2.json

``jaxddp.shard_optimizer(optax.adam)`` over ``--params-mb`` MB of float32 parameters (the
optimizer state is twice that, 1/W of it per rank). Two saves take turns, each until the
checkpoint is complete on disk (``background=False``): ``sliced`` saves the ``ShardedState``
as it is (every rank writes its slices); ``gathered`` first calls ``tx.gather_state`` (every
rank then holds the full state) and saves that, the way before sliced saves. Per save, on
every rank: the time (medians; the slowest rank's) and the peak resident memory it added
above what the process held before it (Linux's ``VmHWM``, reset before each save through
``/proc/self/clear_refs``: it counts NumPy's and XLA's buffers alike).
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
import optax

import jaxddp
from benchmarks.bench_checkpoint import report
from jaxddp._collectives import api as _comm


def _status(field: str) -> int:
    """A ``/proc/self/status`` field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_added(action) -> tuple[float, int]:
    """(seconds, bytes of resident memory the action added at its peak)."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = _status("VmRSS")
    start = time.perf_counter()
    action()
    return time.perf_counter() - start, _status("VmHWM") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--params-mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    comm = _comm.py_comm()
    rank, size = comm.Get_rank(), comm.Get_size()
    n = args.params_mb * (1 << 20) // 4 // 4
    keys = jax.random.split(jax.random.key(0), 4)
    params = {f"w{i}": jax.random.normal(k, (n + i,), jnp.float32) for i, k in enumerate(keys)}
    tx = jaxddp.shard_optimizer(optax.adam(1e-3))
    state = tx.init(params)
    grads = jax.tree.map(lambda p: p * 1e-3, params)
    _, state = jax.jit(tx.update)(grads, state, params)
    jax.block_until_ready(state)
    root = comm.bcast(tempfile.mkdtemp(prefix="jaxddp-bench-sharded-") if rank == 0 else None)
    ckpt = jaxddp.CheckpointManager(root, max_to_keep=2, background=False)

    def sliced(step: int) -> None:
        ckpt.save(step, {"params": params, "opt": state})

    def gathered(step: int) -> None:
        full = tx.gather_state(state, params)
        ckpt.save(step, {"params": params, "opt": full})
        del full

    fns = {"sliced": sliced, "gathered": gathered}
    seconds: dict[str, list[float]] = {k: [] for k in fns}
    added: dict[str, list[int]] = {k: [] for k in fns}
    step = 0
    for r in range(args.repeats + 1):  # the first round warms up
        for name in fns if r % 2 == 0 else list(fns)[::-1]:
            step += 1
            comm.Barrier()
            t, m = peak_added(lambda f=fns[name], s=step: f(s))
            t = max(comm.allgather(t))  # the slowest rank's
            if r > 0:
                seconds[name].append(t)
                added[name].append(m)
    ckpt.close()
    peaks = comm.gather({k: max(v) for k, v in added.items()})
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        state_bytes = 2 * sum(x.nbytes for x in jax.tree.leaves(params))
        result = {
            "ranks": size,
            "params_bytes": int(sum(x.nbytes for x in jax.tree.leaves(params))),
            "optimizer_state_bytes": int(state_bytes),
            "seconds": {k: float(np.median(v)) for k, v in seconds.items()},
            "peak_added_bytes_per_rank": peaks,
            "samples": {"seconds": seconds},
        }
        report(result, args.out)


if __name__ == "__main__":
    main()
