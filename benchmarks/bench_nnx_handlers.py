"""The 100-leaf NNX step with jaxddp's own allreduce handler against mpi4jax's, in one run.

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \\
    mpiexec -bind-to core -n 2 python benchmarks/bench_nnx_handlers.py [--rounds 30] [--steps 20]

The handler is chosen when a step is lowered, so this lowers each synced step twice, once
under each handler (every rank the same); jaxddp's runs its allreduces through the ranks'
shared memory where they are all on one node, or through MPI (switched between rounds, on
every rank alike). So it times seven steps interleaved (five where the ranks span nodes),
round after round: alone (no sync),
the gradients allreduced in each of the three ways, and the 4-byte sync point
(``bench_nnx_step.sync_point``) in each. Each round is ``--steps`` steps back to
back per variant, the ranks lined up before each, the variants in a new random order each
round (in a fixed order, the variant timed right after the step alone may be
favoured: two variants swapped places and swapped results). Printed on rank 0: the median
of each step's per-round time minus the step alone's in the same round (paired), in ms. A
comparison inside one process, so that the host's drift (large on shared 2-core machines)
falls on both handlers alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxddp
from benchmarks.bench_nnx_step import ResidualMLP, make_step, sync_point
from jaxddp import _native


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rank = jaxddp.rank()
    x = jax.random.normal(jax.random.key(1 + rank), (64, 32))
    y = jax.random.randint(jax.random.key(100 + rank), (64,), 0, 10)
    agreed = _native._agreed  # what every rank agreed on at start-up
    if agreed is None or agreed[0] is None:
        msg = f"jaxddp's handler is not in use here: {_native.status()}"
        raise SystemExit(msg)

    def grads() -> optax.GradientTransformation:
        return optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))

    def floor() -> optax.GradientTransformation:
        return optax.chain(sync_point(), optax.adam(1e-3))

    shared = _native.shared_calls() is not None
    # (name, optimizer, handler): jaxddp's through shared memory, jaxddp's through MPI, or
    # mpi4jax's
    ways = (["ours, shared memory"] if shared else []) + ["ours, MPI", "mpi4jax"]
    variants = [("alone", optax.adam(1e-3), "ours, MPI")]
    variants += [(way, grads(), way) for way in ways]
    variants += [(f"sync point, {way}", floor(), way) for way in ways]
    steps = {}
    handler = {}
    for name, tx, way in variants:
        handler[name] = way
        _native._share_on(way == "ours, shared memory")
        ours = way != "mpi4jax"
        _native._agreed = agreed if ours else (None, "mpi4jax's (this benchmark)")
        model = ResidualMLP(24, 64, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = make_step()
        for _ in range(3):  # lowered and compiled here, under this handler
            jax.block_until_ready(step(model, optimizer, x, y))
        steps[name] = (step, model, optimizer)
    _native._agreed = agreed
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(args.rounds):
        order = list(steps)
        random.Random(round_).shuffle(order)  # the same order on every rank
        for name in order:
            step, model, optimizer = steps[name]
            _native._share_on(handler[name] == "ours, shared memory")
            jaxddp.allreduce(np.float32(0))  # line the ranks up
            start = time.perf_counter()
            for _ in range(args.steps):
                out = step(model, optimizer, x, y)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / args.steps)
    _native._share_on(shared)
    if rank == 0:
        alone = times["alone"]
        print(f"step alone: {statistics.median(alone) * 1e3:.2f} ms (median of rounds)")
        for name in list(steps)[1:]:
            paired = statistics.median(a - b for a, b in zip(times[name], alone, strict=True))
            print(f"{name:>32}: adds {paired * 1e3:.3f} ms (paired median)", flush=True)


if __name__ == "__main__":
    main()
