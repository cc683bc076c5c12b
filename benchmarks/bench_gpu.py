"""What gradient sync adds to a GPU train step, against the host-staging limit of the same run.

    mpiexec -n 2 python benchmarks/bench_gpu.py --out benchmarks/results/gpu-np2.json

The model: an MLP of ``--layers`` x ``--width`` (8 x 2048 by default: 33.6M parameters,
134 MB of float32 gradients), ``--batch`` samples per rank, adam. The steps run back to
back, as a training loop runs them, two steps taking turns sample by sample:

- ``with_sync``: ``optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))``;
- ``without_sync``: ``optax.adam(1e-3)``.

``sync = with_sync - without_sync`` is what sync adds to a step. The limit is what a
host-staged allreduce of the gradient bytes costs at least, each part measured alone in the
same run: the bytes copied from the GPU to the host (``jax.device_get`` of one buffer of that
size), reduced across the ranks (mpi4py's ``Allreduce`` of a NumPy buffer: MPICH's shared
memory where the ranks share a node) and copied back (``jax.device_put``). ``ratio = sync /
limit``; jaxddp's staging copies through pinned memory and overlaps the copies with the
reduction, so it can come in under the limit.

Which handlers the collectives run is the job's (``jaxddp doctor``): jaxddp's own by default;
``JAXDDP_NATIVE_ALLREDUCE=0`` for mpi4jax's, staged by mpi4jax.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxddp
from benchmarks.bench_allreduce import interleaved
from benchmarks.steps import optax_step
from jaxddp import _native


def mlp(key: jax.Array, width: int, layers: int) -> dict[str, dict[str, jax.Array]]:
    keys = jax.random.split(key, layers)
    return {
        f"layer{i}": {
            "w": jax.random.normal(k, (width, width), jnp.float32) * (2 / width) ** 0.5,
            "b": jnp.zeros(width, jnp.float32),
        }
        for i, k in enumerate(keys)
    }


def loss_fn(params, batch):
    x, y = batch
    h = x
    for i in range(len(params)):
        h = h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
        h = jax.nn.relu(h) if i < len(params) - 1 else h
    return jnp.mean((h - y) ** 2)


def make_run(tx, params, batch):
    step = jax.jit(optax_step(tx, loss_fn))
    state = [params, tx.init(params)]

    def run():
        p, s, loss = step(state[0], state[1], batch)
        state[0], state[1] = p, s
        jax.block_until_ready(loss)

    return run


def _median(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def limit_parts(nbytes: int, repeats: int) -> dict[str, float]:
    """The three parts of a host-staged allreduce of ``nbytes``, each alone (median s)."""
    from mpi4py import MPI

    from jaxddp._runtime.world import py_comm

    comm = py_comm()
    device = jnp.ones(nbytes // 4, jnp.float32)
    host = np.ones(nbytes // 4, np.float32)
    return {
        "device_to_host_s": _median(lambda: jax.device_get(device), 3, repeats),
        "host_allreduce_s": _median(lambda: comm.Allreduce(MPI.IN_PLACE, host), 3, repeats),
        "host_to_device_s": _median(
            lambda: jax.block_until_ready(jax.device_put(host)), 3, repeats
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256, help="per rank")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rank, size = jaxddp.rank(), jaxddp.world_size()
    params = mlp(jax.random.key(0), args.width, args.layers)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    x = jax.random.normal(jax.random.key(1 + rank), (args.batch, args.width))
    batch = (x, jnp.sin(x))
    runs = {
        "with_sync": make_run(
            optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3)), params, batch
        ),
        "without_sync": make_run(optax.adam(1e-3), params, batch),
    }
    steps = interleaved(runs, 5, args.repeats)
    result = {
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.default_backend(),
        "ranks": size,
        "gradient_bytes": nbytes,
        "batch_per_rank": args.batch,
        "handlers": _native.gpu_status() if jax.default_backend() == "gpu" else _native.status(),
        **{f"{name}_s": s for name, s in steps.items()},
    }
    result["sync_s"] = result["with_sync_s"] - result["without_sync_s"]
    if size > 1:
        parts = limit_parts(nbytes, args.repeats)
        result.update(parts)
        result["limit_s"] = sum(parts.values())
        result["ratio_to_limit"] = result["sync_s"] / result["limit_s"]
    result["step_ratio"] = result["with_sync_s"] / result["without_sync_s"]
    if rank == 0:
        line = ", ".join(
            f"{k} {v * 1e3:.2f} ms" if k.endswith("_s") else f"{k} {v}" for k, v in result.items()
        )
        print(line, flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
