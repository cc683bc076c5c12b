"""Collectives on concrete arrays (outside ``jax.jit``) against mpi4py moving the same bytes.

    mpiexec -n 2 python benchmarks/bench_eager.py --out benchmarks/results/eager-np2.json

What a training loop calls between steps: ``jaxddp.allreduce`` of a few metrics (a tree of
two float32 scalars, as jax arrays) and ``jaxddp.masked_mean`` at evaluation (256 float32
values and a boolean mask, as jax arrays). Outside jit both go through NumPy and mpi4py.
Each is compared with mpi4py's ``Allreduce`` of a preallocated NumPy buffer of the bytes
jaxddp sends: 2 float32 (8 bytes) for the metrics; 2 float64 (16 bytes: the masked sum,
accumulated in double precision, and the count) for ``masked_mean``, which is also shown
against the 8-byte buffer. ``least_*`` is the least any API taking these jax arrays pays
(reading them into NumPy, packing one buffer, the same ``Allreduce``): what is left of the
target once that is paid. For contrast, the same calls jitted (``jax.jit(jaxddp.allreduce)``,
``jax.jit(jaxddp.masked_mean)``): with ``JAXDDP_TEST_COLLECTIVE_PATH=ordered`` those take the
ordered-effect path, while the eager calls are the same NumPy path either way. The eager
calls run with the signature check every collective makes (one more tiny message) and
without it (``*_unchecked``, as ``JAXDDP_CHECK=0``), taking turns in the same launch.
Implementations take turns, one sample each per round; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import switches  # before jaxddp: JAXDDP_TEST_COLLECTIVE_PATH

switches.install()

import jax
import jax.numpy as jnp
import numpy as np

import jaxddp
from benchmarks.bench_allreduce import interleaved
from jaxddp._collectives import api as _comm
from jaxddp._collectives import signature as _signature
from jaxddp._collectives._jax import path as _path


def mpi4py_allreduce(n: int, dtype: type) -> object:
    comm = _comm.py_comm()
    send = np.ones(n, dtype)
    recv = np.empty(n, dtype)
    return lambda: comm.Allreduce(send, recv)


def least_allreduce(tree: dict) -> object:
    """The least any allreduce of these jax arrays pays: each leaf read into NumPy, one
    packed buffer, one ``Allreduce`` in place. No pytree, no mean, no result arrays."""
    comm, MPI = _comm.py_comm(), _comm.mpi()
    leaves = list(tree.values())
    return lambda: comm.Allreduce(
        MPI.IN_PLACE, np.array([np.asarray(x) for x in leaves], np.float32), MPI.SUM
    )


def least_masked_mean(values: jax.Array, mask: jax.Array) -> object:
    """The least any masked mean of these jax arrays pays: both read into NumPy, the masked
    sum and the count packed in one float64 buffer, one ``Allreduce`` in place, one division."""
    comm, MPI = _comm.py_comm(), _comm.mpi()

    def run() -> object:
        v, m = np.asarray(values), np.asarray(mask)
        picked = v[m]
        buffer = np.array([np.add.reduce(picked, dtype=np.float64), len(picked)])
        comm.Allreduce(MPI.IN_PLACE, buffer, MPI.SUM)
        return buffer[0] / buffer[1]

    return run


def unchecked(fn: object) -> object:
    """``fn`` with jaxddp's signature check off (what ``JAXDDP_CHECK=0`` does), to time the
    check by difference in the same launch."""

    def off() -> bool:
        return False

    def run() -> object:
        _signature.enabled = off
        try:
            return fn()  # pyright: ignore[reportCallIssue]
        finally:
            _signature.enabled = checked

    checked = _signature.enabled
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=301)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rank = jaxddp.rank()
    path = "fast" if _path.fast_path() else "ordered"
    metrics = {"loss": jnp.float32(0.5 + rank), "accuracy": jnp.float32(0.25 * rank)}
    values = jax.random.normal(jax.random.key(rank), (256,), jnp.float32)
    mask = jnp.arange(256) < 200 + rank
    jit_allreduce = jax.jit(jaxddp.allreduce)
    jit_masked_mean = jax.jit(jaxddp.masked_mean)
    fns = {
        "limit_f32x2": mpi4py_allreduce(2, np.float32),
        "limit_f64x2": mpi4py_allreduce(2, np.float64),
        "least_allreduce": least_allreduce(metrics),
        "least_masked_mean": least_masked_mean(values, mask),
        "allreduce_eager": lambda: jaxddp.allreduce(metrics),
        "masked_mean_eager": lambda: jaxddp.masked_mean(values, mask),
        "allreduce_eager_unchecked": unchecked(lambda: jaxddp.allreduce(metrics)),
        "masked_mean_eager_unchecked": unchecked(lambda: jaxddp.masked_mean(values, mask)),
        "allreduce_jit": lambda: jax.block_until_ready(jit_allreduce(metrics)),
        "masked_mean_jit": lambda: jax.block_until_ready(jit_masked_mean(values, mask)),
    }
    # the eager results must be what the jitted ones are (and what the sums say)
    eager, jitted = jaxddp.allreduce(metrics), jit_allreduce(metrics)
    size = jaxddp.world_size()
    expected = np.mean([0.5 + r for r in range(size)])
    assert np.isclose(eager["loss"], expected)
    assert np.isclose(jitted["loss"], expected)
    assert np.isclose(jaxddp.masked_mean(values, mask), jit_masked_mean(values, mask), 1e-5)
    assert np.isclose(fns["least_masked_mean"](), jaxddp.masked_mean(values, mask), 1e-5)
    medians = interleaved(fns, args.warmup, args.repeats)
    if rank == 0:
        for name, seconds in medians.items():
            print(f"[{path}] {name:>18} {seconds * 1e6:9.1f} us", flush=True)
    if rank == 0 and args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "ranks": size,
            "path": path,
            "repeats": args.repeats,
            "env": {"jax": jax.__version__},
            "medians_s": medians,
            "env_path": os.environ.get(switches.PATH_VARIABLE, ""),
        }
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
