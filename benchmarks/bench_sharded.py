"""The sharded optimizer's state bytes per rank and step time, against the unsharded chain.

    mpiexec -n 2 python benchmarks/bench_sharded.py --out benchmarks/results/sharded-np2.json
    mpiexec -n 4 python benchmarks/bench_sharded.py --out benchmarks/results/sharded-np4.json

The three residual MLPs of ``bench_nnx_step.py``, each trained the way the Flax docs show
(``nnx.Optimizer(model, tx, wrt=nnx.Param)``, one ``nnx.jit`` step), once with
``optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))`` ("unsharded") and once with
``jaxddp.shard_optimizer(optax.adam(1e-3))`` ("sharded"). The two steps take turns, one
sample each per round (several steps, about a quarter of a second, per sample), as in
``bench_nnx_step.py``. Reported: the optimizer-state bytes each rank holds in each (and the
bound, 1/W of the unsharded state plus the padding), the median step of each, their ratio
(the target: at most 1.15 at 2 ranks) and the median of the per-round ratios.
"""

from __future__ import annotations

import statistics
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import switches  # before jaxddp: JAXDDP_TEST_COLLECTIVE_PATH

switches.install()

import jax
import numpy as np
import optax
from flax import nnx

import jaxddp
from benchmarks.bench_allreduce import interleaved_samples
from benchmarks.bench_nnx_step import (
    MODELS,
    ResidualMLP,
    _steps,
    make_step,
    parse_args,
    write_result,
)
from jaxddp._collectives._jax import path as _path


def _state_bytes(optimizer: nnx.Optimizer) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(nnx.as_pure(optimizer.opt_state)))


def measure(blocks: int, width: int, batch: tuple, warmup: int, repeats: int) -> dict:
    x, y = batch
    size = jaxddp.world_size()
    runs, held = {}, {}
    for name, tx in (
        ("unsharded", optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))),
        ("sharded", jaxddp.shard_optimizer(optax.adam(1e-3))),
    ):
        model = ResidualMLP(blocks, width, nnx.Rngs(0))  # the same weights on every rank
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        held[name] = _state_bytes(optimizer)
        step = make_step()
        runs[name] = lambda s=step, m=model, o=optimizer: jax.block_until_ready(s(m, o, x, y))
    for run in runs.values():
        run()
    one = min(timeit.repeat(runs["unsharded"], number=1, repeat=3))
    one = float(jaxddp.allreduce(np.float64(one), op="max"))  # every rank the same count
    steps = max(1, min(10, round(0.25 / one)))
    timed = {name: _steps(run, steps) for name, run in runs.items()}
    samples = interleaved_samples(timed, warmup, repeats)
    samples = {k: [t / steps for t in v] for k, v in samples.items()}
    medians = {name: statistics.median(s) for name, s in samples.items()}
    paired = [a / b for a, b in zip(samples["sharded"], samples["unsharded"], strict=True)]
    params = jax.tree.leaves(nnx.state(ResidualMLP(blocks, width, nnx.Rngs(0)), nnx.Param))
    count = 4  # adam's step counter, int32, held whole on every rank
    bound = (held["unsharded"] - count) / size + 2 * (size - 1) * 4 + count
    return {
        "param_leaves": len(params),
        "param_bytes": sum(int(p.size) * 4 for p in params),
        "state_bytes_unsharded": held["unsharded"],
        "state_bytes_sharded": held["sharded"],
        "state_bytes_bound": bound,
        "steps_per_sample": steps,
        "unsharded_s": medians["unsharded"],
        "sharded_s": medians["sharded"],
        "ratio": medians["sharded"] / medians["unsharded"],
        "ratio_paired": statistics.median(paired),
    }


def main() -> None:
    args, (x, y) = parse_args(__doc__ or "")
    rank = jaxddp.rank()
    path = "fast" if _path.fast_path() else "ordered"
    rows = []
    for name in args.models.split(";"):
        blocks, width = MODELS[name]
        row = {"model": name, **measure(blocks, width, (x, y), args.warmup, args.repeats)}
        rows.append(row)
        if rank == 0:
            print(
                f"{name:>22} [{path}, {jaxddp.world_size()} ranks] state per rank "
                f"{row['state_bytes_sharded'] / 1e6:.3f} MB sharded vs "
                f"{row['state_bytes_unsharded'] / 1e6:.3f} MB (bound "
                f"{row['state_bytes_bound'] / 1e6:.3f} MB); step "
                f"{row['sharded_s'] * 1e3:.3f} ms sharded vs {row['unsharded_s'] * 1e3:.3f} ms "
                f"-> {row['ratio']:.3f}x (paired {row['ratio_paired']:.3f}x; "
                f"{row['steps_per_sample']} steps per sample)",
                flush=True,
            )
    if rank == 0 and args.out:
        write_result(args, path, rows)


if __name__ == "__main__":
    main()
