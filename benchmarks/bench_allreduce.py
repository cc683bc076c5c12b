"""Gradient allreduce: jaxddp against the MPI limit and its peers, side by side in one run.

    mpiexec -n 2 python benchmarks/bench_allreduce.py --out benchmarks/results/allreduce-np2.json

Every implementation reduces the same float32 gradient-shaped trees (see payloads.py). A
sample is the slowest rank's time for one reduction, the ranks lined up by a barrier first;
the figure is the median over ``--repeats`` samples after ``--warmup`` untimed ones. The
implementations take turns, one sample each per round, so that a slow spell of the machine
falls on all of them instead of on whichever was being measured. The
limit is mpi4py's ``Allreduce`` of one preallocated flat numpy buffer of the same size: no
JAX, no copies, no allocation.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import jaxddp
from benchmarks.payloads import PAYLOADS, make_tree, nbytes
from jaxddp._collectives import api as _comm


def _sample(fn: Callable[[], object]) -> float:
    """The slowest rank's seconds for one call of fn, the ranks lined up by a barrier.

    Python's garbage collector is off while fn runs (as ``timeit`` does): a collection that
    lands in one rank's sample stalls every rank of a synchronous step, so with it on, which
    variant pays for the garbage of all of them is chance. Each sample starts collected."""
    comm = _comm.py_comm()
    gc.collect()
    comm.Barrier()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return comm.allreduce(elapsed, op=_comm.mpi().MAX)


def interleaved(fns: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict:
    """Median seconds of each fn, the fns taking turns: one sample of each per round.

    Each round starts one place further along, so that no fn always runs first (the first
    sample of a round measured up to 2x slower here) or always after the same neighbour.
    """
    samples = interleaved_samples(fns, warmup, repeats)
    return {name: statistics.median(s) for name, s in samples.items()}


def interleaved_samples(
    fns: dict[str, Callable[[], object]], warmup: int, repeats: int
) -> dict[str, list[float]]:
    """What :func:`interleaved` takes the medians of: each fn's samples, round by round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(_sample(fns[name]))
    return samples


def impl_limit(tree: dict[str, np.ndarray]) -> Callable[[], object]:
    comm = _comm.py_comm()
    total = sum(x.size for x in tree.values())
    send = np.concatenate([x.ravel() for x in tree.values()])
    recv = np.empty(total, np.float32)
    return lambda: comm.Allreduce(send, recv)


def impl_mpi4jax_per_leaf(tree: dict[str, np.ndarray]) -> Callable[[], object]:
    m, comm, MPI = _comm.mpi4jax(), _comm.jax_comm(), _comm.mpi()
    f = jax.jit(lambda t: jax.tree.map(lambda x: m.allreduce(x, MPI.SUM, comm=comm), t))
    device_tree = jax.tree.map(jnp.asarray, tree)
    return lambda: jax.block_until_ready(f(device_tree))


def impl_mpi4jax_concat(tree: dict[str, np.ndarray]) -> Callable[[], object]:
    m, comm, MPI = _comm.mpi4jax(), _comm.jax_comm(), _comm.mpi()

    def f(t):
        leaves, treedef = jax.tree.flatten(t)
        flat = m.allreduce(jnp.concatenate([x.ravel() for x in leaves]), MPI.SUM, comm=comm)
        out, offset = [], 0
        for x in leaves:
            out.append(flat[offset : offset + x.size].reshape(x.shape))
            offset += x.size
        return jax.tree.unflatten(treedef, out)

    g = jax.jit(f)
    device_tree = jax.tree.map(jnp.asarray, tree)
    return lambda: jax.block_until_ready(g(device_tree))


def impl_jaxddp(tree: dict[str, np.ndarray]) -> Callable[[], object]:
    tx = jaxddp.allreduce_gradients()
    params = jax.tree.map(jnp.asarray, tree)
    state = tx.init(params)
    f = jax.jit(lambda g: tx.update(g, state, params)[0])
    grads = jax.tree.map(jnp.asarray, tree)
    return lambda: jax.block_until_ready(f(grads))


def impl_jit_floor(tree: dict[str, np.ndarray]) -> Callable[[], object]:
    """What any jitted mpi4jax reduction of this tree pays before moving a byte: the same
    leaves in and out of a jitted function that holds one (scalar) mpi4jax call. A jitted
    function with an MPI op is dispatched on JAX's Python path, at some microseconds per
    input and output leaf."""
    m, comm, MPI = _comm.mpi4jax(), _comm.jax_comm(), _comm.mpi()
    f = jax.jit(lambda t: (jax.tree.map(lambda x: x * 2, t), m.allreduce(1.0, MPI.SUM, comm=comm)))
    device_tree = jax.tree.map(jnp.asarray, tree)
    return lambda: jax.block_until_ready(f(device_tree))


def impl_jit_nompi(tree: dict[str, np.ndarray]) -> Callable[[], object]:
    """The cheapest jitted update of this tree JAX has: every leaf doubled, no MPI, so JAX's
    C++ dispatch path. No jitted reduction whose leaves are its arguments can beat it."""
    f = jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t))
    device_tree = jax.tree.map(jnp.asarray, tree)
    return lambda: jax.block_until_ready(f(device_tree))


def _free_port_from_rank0() -> int:
    import socket

    port = 0
    if jaxddp.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return _comm.py_comm().bcast(port, root=0)


_jax_gloo_ready = False


def impl_jax_gloo(tree: dict[str, np.ndarray]) -> Callable[[], object]:
    """JAX's own CPU collectives: jax.distributed over gloo, psum of the tree in a shard_map."""
    return _jax_gloo(tree)


def impl_jax_gloo_flat(tree: dict[str, np.ndarray]) -> Callable[[], object]:
    """The same transport's best case: one psum of a flat buffer prepared outside."""
    return _jax_gloo({"flat": np.concatenate([x.ravel() for x in tree.values()])})


def _jax_gloo(tree: dict[str, np.ndarray]) -> Callable[[], object]:
    global _jax_gloo_ready
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if not _jax_gloo_ready:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{_free_port_from_rank0()}", jaxddp.world_size(), jaxddp.rank()
        )
        _jax_gloo_ready = True
    mesh = Mesh(np.array(jax.devices()), ("i",))
    sharding = NamedSharding(mesh, P("i"))
    arrays = {k: jax.make_array_from_process_local_data(sharding, v[None]) for k, v in tree.items()}
    f = jax.jit(
        jax.shard_map(
            lambda t: jax.tree.map(lambda x: jax.lax.psum(x, "i"), t),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P(),
            check_vma=False,
        )
    )
    return lambda: jax.block_until_ready(f(arrays))


def start_torch_gloo() -> None:
    """torch.distributed's gloo process group over the ranks, started once."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{_free_port_from_rank0()}",
            rank=jaxddp.rank(),
            world_size=jaxddp.world_size(),
        )


def impl_torch_gloo(tree: dict[str, np.ndarray]) -> Callable[[], object]:
    """torch.distributed over gloo: one in-place all_reduce of a flat tensor (DDP's bucket)."""
    import torch
    import torch.distributed as dist

    start_torch_gloo()
    flat = torch.from_numpy(np.concatenate([x.ravel() for x in tree.values()]))
    return lambda: dist.all_reduce(flat)


IMPLS = {
    "limit": impl_limit,
    "jit_nompi": impl_jit_nompi,
    "jit_floor": impl_jit_floor,
    "jaxddp": impl_jaxddp,
    "mpi4jax_per_leaf": impl_mpi4jax_per_leaf,
    "mpi4jax_concat": impl_mpi4jax_concat,
    # these start a second runtime beside MPI: run them in launches of their own
    "jax_gloo": impl_jax_gloo,
    "jax_gloo_flat": impl_jax_gloo_flat,
    "torch_gloo": impl_torch_gloo,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--impls", default="limit,jaxddp,mpi4jax_per_leaf,mpi4jax_concat,jit_nompi,jit_floor"
    )
    parser.add_argument("--payloads", default=",".join(PAYLOADS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rank, size = jaxddp.rank(), jaxddp.world_size()
    rows = []
    for payload in args.payloads.split(","):
        shapes = PAYLOADS[payload]
        tree = make_tree(shapes, seed=rank)
        # the largest payloads get fewer samples: each one takes a tenth of a second
        repeats = args.repeats if nbytes(shapes) < 50e6 else max(5, args.repeats // 2)
        impls = args.impls.split(",")
        fns = {name: IMPLS[name](tree) for name in dict.fromkeys(impls)}
        medians = interleaved(fns, args.warmup, repeats)
        del fns  # the largest payload's device copies add up
        for name, seconds in medians.items():
            rows.append(
                {
                    "payload": payload,
                    "bytes": nbytes(shapes),
                    "leaves": len(shapes),
                    "impl": name,
                    "ranks": size,
                    "median_s": seconds,
                }
            )
            if rank == 0:
                print(f"{payload:>22} {name:>18} {seconds * 1e3:9.3f} ms", flush=True)
    if rank == 0 and args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        env = {"jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
        args.out.write_text(json.dumps({"ranks": size, "rows": rows, "env": env}, indent=1))


if __name__ == "__main__":
    main()
