"""End-to-end train steps, with and without gradient sync, with the state as a tree or flat.

    mpiexec -n 2 python benchmarks/bench_step.py --out benchmarks/results/step-np2.json

Each case runs the same jitted step (forward, backward, adam) twice: with
``optax.chain(jaxddp.allreduce_gradients(), optax.adam)`` and with plain ``optax.adam``. The
difference is what gradient sync costs a step.

The cases:

- ``digits MLP``: the example model (6 leaves), as in ``jaxddp.examples.digits``.
- models with many leaves (the ResNet-50 x0.1 leaf shapes: 161 leaves; 1000 leaves of 1 KB)
  and a deliberately cheap loss, so that what is measured is the per-leaf cost of the step,
  not arithmetic. Each runs twice: with the parameters as a tree, and raveled into one flat
  vector by ``jax.flatten_util.ravel_pytree`` (unraveled inside the step). A jitted
  function holding an MPI call is dispatched on JAX's Python path, at some microseconds for
  every leaf of its arguments and results (parameters, gradients' optimizer state), so the
  layout of the state decides what sync costs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

import jaxddp
from benchmarks.bench_allreduce import interleaved
from benchmarks.payloads import PAYLOADS, make_tree
from benchmarks.steps import optax_step

MLP_SIZES = (64, 128, 10)


def mlp_params(key: jax.Array, sizes: tuple[int, ...]) -> dict[str, dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return {
        f"layer{i}": {
            "w": jax.random.normal(k, (a, b)) * (2 / a) ** 0.5,
            "b": jnp.zeros(b),
        }
        for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))
    }


def mlp_loss(params, batch):
    x, y = batch
    h = x
    for i in range(len(params)):
        layer = params[f"layer{i}"]
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def many_leaf_loss(params, batch):
    """A cheap stand-in for a model with many parameter arrays: every leaf gets a gradient."""
    return sum(jnp.mean((leaf * batch - 1.0) ** 2) for leaf in jax.tree.leaves(params))


def make_step(tx, loss_fn):
    return jax.jit(optax_step(tx, loss_fn))


def flat(params: Any, loss_fn: Callable) -> tuple[jax.Array, Callable]:
    """The same model with its parameters raveled into one vector."""
    vector, unravel = ravel_pytree(params)
    return vector, lambda v, batch: loss_fn(unravel(v), batch)


def measure(params: Any, loss_fn: Callable, batch: Any, repeats: int) -> dict[str, float]:
    runs = {}
    for name, tx in (
        ("with_sync", optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))),
        ("without_sync", optax.adam(1e-3)),
    ):
        step = make_step(tx, loss_fn)
        state = [params, tx.init(params)]

        def run(step=step, state=state):
            p, s, loss = step(state[0], state[1], batch)
            state[0], state[1] = p, s
            jax.block_until_ready(loss)

        runs[name] = run
    result = {f"{name}_s": s for name, s in interleaved(runs, 5, repeats).items()}
    result["sync_s"] = result["with_sync_s"] - result["without_sync_s"]
    result["communication_share"] = 1 - result["without_sync_s"] / result["with_sync_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="per rank, digits MLP")
    parser.add_argument("--repeats", type=int, default=51)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rank = jaxddp.rank()
    x = jax.random.normal(jax.random.key(1 + rank), (args.batch_size, MLP_SIZES[0]))
    y = jax.random.randint(jax.random.key(2), (args.batch_size,), 0, MLP_SIZES[-1])
    mlp = mlp_params(jax.random.key(0), MLP_SIZES)
    cases: list[tuple[str, str, Any, Callable, Any]] = [
        (f"digits MLP {list(MLP_SIZES)}", "tree", mlp, mlp_loss, (x, y))
    ]
    scale = jax.random.normal(jax.random.key(1 + rank), ())
    for payload in ("ResNet-50 x0.1", "1000 x 1KB"):
        shapes = PAYLOADS[payload]
        tree = jax.tree.map(jnp.asarray, make_tree(shapes, seed=0))
        model = f"{payload} shapes, {len(shapes)} leaves"
        cases.append((model, "tree", tree, many_leaf_loss, scale))
        cases.append((model, "flat", *flat(tree, many_leaf_loss), scale))
    rows = []
    for model, layout, params, loss_fn, batch in cases:
        row = {"model": model, "layout": layout, **measure(params, loss_fn, batch, args.repeats)}
        rows.append(row)
        if rank == 0:
            print(
                f"{model:>40} {layout:>4}: with sync {row['with_sync_s'] * 1e3:8.3f} ms, "
                f"without {row['without_sync_s'] * 1e3:8.3f} ms",
                flush=True,
            )
    if rank == 0 and args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"ranks": jaxddp.world_size(), "batch_per_rank": args.batch_size, "cases": rows}
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
