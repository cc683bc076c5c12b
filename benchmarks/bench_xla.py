"""jaxddp's two paths for a step's collectives, timed in one launch: MPI, XLA, JAX's own.

    JAXDDP_COLLECTIVES=xla mpiexec -n 2 python benchmarks/bench_xla.py --out xla-np2.json

With ``JAXDDP_COLLECTIVES=xla`` a step wrapped in ``jaxddp.spmd`` runs over the ranks' mesh
with JAX's collectives (gloo across the processes on a CPU), while the same step under plain
``jax.jit`` keeps jaxddp's MPI collectives. In one process, taking turns (``interleaved``
medians of back-to-back steps):

* training steps (forward, backward, adam): without sync (``jax.jit``), the MPI path
  (``jax.jit`` with ``allreduce_gradients``), the XLA path (the same step in
  ``jaxddp.spmd``), and JAX's own multi-process data parallelism (``own``: one ``jax.jit``
  over the ranks' mesh, the parameters and optimizer state replicated global arrays fed
  back, each call's batch made global from the ranks' blocks, the loss a mean over the
  global batch, whose gradient XLA all-reduces itself); the limit, mpi4py's flat
  ``Allreduce`` of the gradient's bytes, beside them. Cases: the digits example's MLP (6
  leaves), a residual MLP of 20 leaves (1.1 MB), the ResNet-50 x0.1 leaf shapes (161);
* dispatch: a step without communication (``dispatch``: every parameter leaf, f32[16],
  scaled and fed back; the loss, a mean of this rank's batch, returned) at 6, 161 and 600
  leaves: ``jax.jit`` on one rank's arrays, ``jaxddp.spmd``, and JAX's own (its loss is the
  global batch's mean: one 4-byte all-reduce the per-rank step does not make).
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
import numpy as np
import optax

import jaxddp
from benchmarks.bench_allreduce import impl_limit, interleaved
from benchmarks.bench_step import MLP_SIZES, many_leaf_loss, mlp_loss, mlp_params
from benchmarks.payloads import PAYLOADS, make_tree
from benchmarks.steps import optax_step
from jaxddp._base import settings


def residual_params(key: jax.Array, width: int = 256, blocks: int = 4) -> dict[str, Any]:
    keys = jax.random.split(key, blocks + 1)
    params = {
        f"block{i}": {"w": jax.random.normal(k, (width, width)) / width**0.5, "b": jnp.zeros(width)}
        for i, k in enumerate(keys[:blocks])
    }
    params["in"] = {"w": jax.random.normal(keys[-1], (64, width)) / 8, "b": jnp.zeros(width)}
    params["out"] = {"w": jnp.zeros((width, 10)), "b": jnp.zeros(10)}
    for i in range(blocks):  # 2 more leaves per block: a layer norm's scale and offset
        params[f"block{i}"]["scale"], params[f"block{i}"]["offset"] = (
            jnp.ones(width),
            jnp.zeros(width),
        )
    return params


def residual_loss(params: Any, batch: Any) -> jax.Array:
    x, y = batch
    h = x @ params["in"]["w"] + params["in"]["b"]
    for i in range(sum(k.startswith("block") for k in params)):
        p = params[f"block{i}"]
        z = (h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-5)
        h = h + jax.nn.relu((z * p["scale"] + p["offset"]) @ p["w"] + p["b"])
    logits = h @ params["out"]["w"] + params["out"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _mesh_and_shardings() -> tuple[Any, Any, Any]:
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxddp._runtime import distributed

    mesh = distributed.mesh()
    axis = mesh.axis_names[0]
    return mesh, NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(axis))


def own_program(step: Callable, params: Any, state: Any, batch: Any) -> Callable[[], Any]:
    """JAX's own data parallelism for ``step(params, state, global_batch) -> (params, state,
    loss)``: ``params`` and ``state`` replicated global arrays fed back, ``batch`` (this
    rank's block) made global at every call, as a multi-process JAX program feeds its
    loader's batches."""
    _, replicated, blocked = _mesh_and_shardings()
    run = jax.jit(step, out_shardings=replicated)
    held = list(jax.device_put((params, state), replicated))
    local = jax.tree.map(np.asarray, batch)

    def once() -> Any:
        global_batch = jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(blocked, x), local
        )
        held[0], held[1], loss = run(held[0], held[1], global_batch)
        return jax.block_until_ready(loss)

    return once


def _stacked(batch: Any) -> Any:
    """A per-rank batch of scalars as a vector of one (JAX's own stacks the ranks' blocks)."""
    return jax.tree.map(lambda x: jnp.reshape(x, (1,)) if jnp.ndim(x) == 0 else x, batch)


def measure(params: Any, loss_fn: Callable, batch: Any, repeats: int) -> dict[str, float]:
    def make(tx: Any, wrap: Callable) -> Callable[[], None]:
        run = wrap(optax_step(tx, loss_fn))
        state = [params, tx.init(params)]

        def once() -> None:
            state[0], state[1], loss = run(state[0], state[1], batch)
            jax.block_until_ready(loss)

        return once

    def global_step(params, opt_state, batch):  # the loss: the global batch's mean
        def loss(p):
            if jax.tree.leaves(batch)[0].ndim == 1 and loss_fn is many_leaf_loss:
                return jnp.mean(jax.vmap(lambda b: loss_fn(p, b))(batch))
            return loss_fn(p, batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    adam = optax.adam(1e-3)
    synced = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))
    fns = {
        "without_sync": make(optax.adam(1e-3), jax.jit),
        "mpi": make(synced, jax.jit),
        "xla": make(synced, jaxddp.spmd),
        "own": own_program(global_step, params, adam.init(params), _stacked(batch)),
        "limit": impl_limit({k: np.asarray(v) for k, v in _flat_named(params).items()}),
    }
    return {f"{name}_s": s for name, s in interleaved(fns, 5, repeats).items()}


def measure_dispatch(leaves: int, batch: Any, repeats: int) -> dict[str, float]:
    """Per call of a step without communication: one rank's ``jax.jit``, ``jaxddp.spmd``,
    JAX's own program."""
    params = {f"p{i:03d}": jnp.full(16, 1.0 + i / leaves, jnp.float32) for i in range(leaves)}

    def step(params, batch):
        return jax.tree.map(lambda p: p * 0.999, params), jnp.mean(batch)

    def own_step(params, _unused, batch):
        new, loss = step(params, batch)
        return new, _unused, loss

    def make(wrap: Callable) -> Callable[[], Any]:
        run = wrap(step)
        held = [params]

        def once() -> Any:
            held[0], loss = run(held[0], batch)
            return jax.block_until_ready(loss)

        return once

    fns = {
        "jit": make(jax.jit),
        "spmd": make(jaxddp.spmd),
        "own": own_program(own_step, params, jnp.zeros(()), batch),
    }
    return {f"{name}_s": s for name, s in interleaved(fns, 5, repeats).items()}


def _flat_named(params: Any) -> dict[str, jax.Array]:
    return {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(params))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if settings.collectives() != "xla":
        sys.exit("run with JAXDDP_COLLECTIVES=xla (see the module's docstring)")
    rank = jaxddp.rank()
    x = jax.random.normal(jax.random.key(1 + rank), (args.batch_size, 64))
    y = jax.random.randint(jax.random.key(2 + rank), (args.batch_size,), 0, 10)
    resnet = PAYLOADS["ResNet-50 x0.1"]
    cases = [
        ("digits MLP, 6 leaves", mlp_params(jax.random.key(0), MLP_SIZES), mlp_loss, (x, y)),
        ("residual MLP 4 x 256, 20 leaves", residual_params(jax.random.key(0)), residual_loss,
         (x, y)),
        (f"ResNet-50 x0.1 shapes, {len(resnet)} leaves",
         jax.tree.map(jnp.asarray, make_tree(resnet, seed=0)), many_leaf_loss,
         jax.random.normal(jax.random.key(1 + rank), ())),
    ]  # fmt: skip
    rows, dispatch = [], []
    for leaves in (6, 161, 600):
        row = {"leaves": leaves, **measure_dispatch(leaves, x, args.repeats)}
        dispatch.append(row)
        if rank == 0:
            print(
                f"dispatch, {leaves:3d} leaves: jit (one rank) {row['jit_s'] * 1e3:6.3f} ms, "
                f"spmd {row['spmd_s'] * 1e3:6.3f} ms, JAX's own {row['own_s'] * 1e3:6.3f} ms, "
                f"spmd / own {row['spmd_s'] / row['own_s']:.2f}x",
                flush=True,
            )
    for model, params, loss_fn, batch in cases:
        row = {"model": model, **measure(params, loss_fn, batch, args.repeats)}
        rows.append(row)
        if rank == 0:
            base = row["without_sync_s"]
            print(
                f"{model:>36}: no sync {base * 1e3:7.2f} ms, MPI path "
                f"{row['mpi_s'] * 1e3:7.2f} ms, XLA path {row['xla_s'] * 1e3:7.2f} ms, "
                f"JAX's own {row['own_s'] * 1e3:7.2f} ms (XLA / own "
                f"{row['xla_s'] / row['own_s']:.2f}x), limit {row['limit_s'] * 1e3:6.3f} ms",
                flush=True,
            )
    if rank == 0 and args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "ranks": jaxddp.world_size(),
            "batch_per_rank": args.batch_size,
            "jax": jax.__version__,
            "cases": rows,
            "dispatch": dispatch,
        }
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
