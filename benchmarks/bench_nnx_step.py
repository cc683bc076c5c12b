"""A Flax NNX train step as a new user writes it, with and without gradient sync.

    mpiexec -bind-to core -n 2 python benchmarks/bench_nnx_step.py --out benchmarks/results/nnx-step-np2.json

(``-bind-to core``, MPICH's spelling, keeps each rank on a core of its own, as Open MPI's
``mpirun`` does by default: see benchmarks/run.py.)

Three residual MLPs (the models of the step benchmarks, also in ``bench_sharded.py`` and
``bench_watchdog.py``): a first ``nnx.Linear(32, width)``, ``blocks`` residual blocks
``x + LayerNorm(relu(Linear(width, width)(x)))``, a final ``nnx.Linear(width, 10)``:

- 4 blocks of width 256: 20 parameter leaves, 1.10 MB of float32 gradients;
- 24 blocks of width 64: 100 leaves, 0.42 MB;
- 100 blocks of width 32: 404 leaves, 0.45 MB.

Each model is trained the way the Flax docs show: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``
and one ``nnx.jit`` step (loss, ``nnx.value_and_grad``, ``optimizer.update(model, grads)``),
once with ``optax.adam(1e-3)`` alone and once with
``optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))``. The two steps and the limit
(mpi4py's ``Allreduce`` of one flat float32 buffer of the same gradient bytes) take turns, one
sample each per round (a sample is several steps, about a quarter of a second, per step). "Sync
adds" is median(step with sync) - median(step alone), also in units of the limit.

A third step, ``optax.chain(sync_point(), optax.adam(1e-3))``, allreduces one float32 zero:
the least any synchronous step pays, since every step then waits for the slowest rank's
backward pass. What the gradients cost beyond it ("beyond the sync point") is the part that
moving the gradient bytes adds.

Which path jaxddp's collectives take inside ``jax.jit`` is decided once per process; run with
``JAXDDP_TEST_COLLECTIVE_PATH=ordered`` for the ordered-effect path (the "before" column).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import switches  # before jaxddp: JAXDDP_TEST_COLLECTIVE_PATH

switches.install()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxddp
from benchmarks.bench_allreduce import impl_limit, interleaved_samples
from jaxddp._collectives._jax import path as _path

D_IN, D_OUT = 32, 10
MODELS = {  # name: (blocks, width)
    "4 blocks, width 256": (4, 256),
    "24 blocks, width 64": (24, 64),
    "100 blocks, width 32": (100, 32),
}


class Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(width, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.norm(jax.nn.relu(self.linear(x)))


class ResidualMLP(nnx.Module):
    def __init__(self, blocks: int, width: int, rngs: nnx.Rngs) -> None:
        self.inp = nnx.Linear(D_IN, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, rngs) for _ in range(blocks)])
        self.out = nnx.Linear(width, D_OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def make_step():
    """A fresh ``nnx.jit`` train step, as in the Flax docs."""

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return train_step


def sync_point() -> optax.GradientTransformation:
    """The least a synchronous step can do: one allreduce of a float32 zero, added to the
    updates (so that it is neither removed nor moved out of the step)."""

    def update(updates, state, params=None):
        zero = jaxddp.allreduce(jnp.zeros((), jnp.float32), op="sum")
        return jax.tree.map(lambda u: u + zero, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def measure(blocks: int, width: int, batch: tuple, warmup: int, repeats: int) -> dict:
    x, y = batch
    runs = {}
    for name, tx in (
        ("alone", optax.adam(1e-3)),
        ("floor", optax.chain(sync_point(), optax.adam(1e-3))),
        ("with_sync", optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))),
    ):
        model = ResidualMLP(blocks, width, nnx.Rngs(0))  # the same weights on every rank
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = make_step()
        runs[name] = lambda s=step, m=model, o=optimizer: jax.block_until_ready(s(m, o, x, y))
    # Several steps per sample (about a quarter of a second): one step's noise here is a
    # large part of a step, and a step's sync waits for the slowest rank of that step.
    for run in runs.values():
        run()
    one = min(timeit.repeat(runs["alone"], number=1, repeat=3))
    one = float(jaxddp.allreduce(np.float64(one), op="max"))  # every rank the same count
    steps = max(1, min(10, round(0.25 / one)))
    timed = {name: _steps(run, steps) for name, run in runs.items()}
    params = jax.tree.leaves(nnx.state(ResidualMLP(blocks, width, nnx.Rngs(0)), nnx.Param))
    grads = {f"p{i}": np.zeros(p.shape, np.float32) for i, p in enumerate(params)}
    timed["limit"] = impl_limit(grads)
    samples = interleaved_samples(timed, warmup, repeats)
    samples = {k: [t / (1 if k == "limit" else steps) for t in v] for k, v in samples.items()}
    medians = {name: statistics.median(s) for name, s in samples.items()}
    sync = medians["with_sync"] - medians["alone"]
    floor = medians["floor"] - medians["alone"]
    # A check on the noise: the same difference taken within each round, then the median.
    paired = [a - b for a, b in zip(samples["with_sync"], samples["alone"], strict=True)]
    quartiles = statistics.quantiles(samples["alone"], n=4)
    return {
        "param_leaves": len(params),
        "grad_bytes": sum(int(p.size) * 4 for p in params),
        "steps_per_sample": steps,
        "alone_s": medians["alone"],
        "alone_iqr_s": quartiles[2] - quartiles[0],
        "with_sync_s": medians["with_sync"],
        "floor_s": medians["floor"],
        "limit_s": medians["limit"],
        "sync_s": sync,
        "sync_in_limits": sync / medians["limit"],
        "sync_paired_s": statistics.median(paired),
        "floor_sync_s": floor,
        "beyond_floor_in_limits": (sync - floor) / medians["limit"],
    }


def _steps(run: Callable[[], object], steps: int) -> Callable[[], None]:
    def many() -> None:
        for _ in range(steps):
            run()

    return many


def parse_args(doc: str) -> tuple[argparse.Namespace, tuple[jax.Array, jax.Array]]:
    """The options of the NNX step benchmarks (this one and bench_sharded.py), and this
    rank's batch."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--models", default=";".join(MODELS), help="';'-separated names")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rank = jaxddp.rank()
    x = jax.random.normal(jax.random.key(1 + rank), (args.batch_size, D_IN))
    y = jax.random.randint(jax.random.key(100 + rank), (args.batch_size,), 0, D_OUT)
    return args, (x, y)


def write_result(args: argparse.Namespace, path: str, rows: list[dict]) -> None:
    """The run's rows and settings as JSON in ``args.out`` (rank 0 calls it)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "ranks": jaxddp.world_size(),
        "path": path,
        "batch_per_rank": args.batch_size,
        "repeats": args.repeats,
        "env": {"jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")},
        "cases": rows,
    }
    args.out.write_text(json.dumps(result, indent=1))


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
                f"{name:>22} [{path}] {row['param_leaves']} leaves "
                f"{row['grad_bytes'] / 1e6:.2f} MB: alone {row['alone_s'] * 1e3:.3f} ms, "
                f"with sync {row['with_sync_s'] * 1e3:.3f} ms, limit "
                f"{row['limit_s'] * 1e3:.3f} ms -> sync adds {row['sync_s'] * 1e3:.3f} ms "
                f"({row['sync_in_limits']:.2f}x the limit; paired {row['sync_paired_s'] * 1e3:.3f} "
                f"ms, step alone IQR {row['alone_iqr_s'] * 1e3:.3f} ms; a 4-byte sync point adds "
                f"{row['floor_sync_s'] * 1e3:.3f} ms, the gradients "
                f"{row['beyond_floor_in_limits']:.2f}x the limit beyond it; "
                f"{row['steps_per_sample']} steps per sample)",
                flush=True,
            )
    if rank == 0 and args.out:
        write_result(args, path, rows)


if __name__ == "__main__":
    main()
