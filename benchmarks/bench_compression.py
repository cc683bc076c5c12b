"""Gradient compression across an emulated link: the sync step at full width, bf16 and
PowerSGD of rank 1, 4 and 16, taking turns in one launch per link speed.

    sudo-less root only:  python benchmarks/bench_compression.py --rates 1gbit,10gbit,none

The driver launches ``mpiexec -launcher fork -hosts n0:1,n1:1 -n 2`` once per link speed
(hydra's simulated nodes, one rank each: jaxddp's shared-memory allreduce, which serves the
ranks of one node, stays out, as between real nodes) with ``UCX_TLS=tcp MPIR_CVAR_NOLOCAL=1``
(the ``mpich`` wheel's ch4 device runs UCX, which otherwise moves the bytes through shared
memory), and for a throttled speed puts a token bucket on the loopback
device first (``tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 50ms``). The
bucket slows every local connection of the machine, so it is removed as soon as that launch
ends, in every case (``finally``, and SIGINT/SIGTERM handlers); never set it in tests or CI.

Each rank (``--worker``) times, interleaved (medians), the jitted
``allreduce_gradients(compression=...)`` update of a fixed gradient tree (the sync alone, the
error feedback included) and, for each compression, its own arithmetic without the
collectives (``compute``). Models: ``25M`` (six 2048 x 2048 float32 matrices and their
biases, 25.2 M parameters) and the residual MLP of ``bench_xla.residual_params`` (281 k).
From the 1 and 10 Gbit/s times it fits ``t = a + b / rate`` per choice and reports the rate
below which each compressed choice beats full width.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHOICES = ["full", "bf16", "psgd1", "psgd4", "psgd16"]


# -- the driver: one launch per link speed, the bucket set and removed around it ------------


def _tc(*args: str) -> None:
    subprocess.run(["tc", "qdisc", *args], check=False, capture_output=True)


def _unthrottle(*_: Any) -> None:
    _tc("del", "dev", "lo", "root")


def _launch(rate: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, UCX_TLS="tcp", MPIR_CVAR_NOLOCAL="1", PYTHONPATH=str(ROOT))
    out = Path(f"/tmp/bench_compression_{os.getpid()}_{rate}.json")
    # one rank per node, as hydra simulates nodes on one machine: jaxddp's shared-memory
    # allreduce (ranks of one node) stays out, as it does between real nodes
    hosts = ",".join(f"n{i}:1" for i in range(args.np))
    command = ["mpiexec", "-launcher", "fork", "-hosts", hosts, "-n", str(args.np)]
    command += [sys.executable, __file__, "--worker"]
    command += ["--repeats", str(args.repeats), "--out", str(out)]
    if args.models:
        command += ["--models", args.models]
    command += ["--choices", args.choices]
    try:
        if rate != "none":
            _unthrottle()
            _tc("add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "256kb", "latency",
                "50ms")  # fmt: skip
        subprocess.run(command, env=env, check=True, timeout=args.timeout)
    finally:
        if rate != "none":
            _unthrottle()
    return json.loads(out.read_text())


def _fit(t1: float, t10: float) -> tuple[float, float]:
    """``t = a + b / rate`` (rate in Gbit/s) through the 1 and 10 Gbit/s times."""
    b = (t1 - t10) / (1 - 0.1)
    return t1 - b, b


def _ordered(row: dict[str, Any]) -> list[str]:
    """The choices of a row in :data:`CHOICES`' order (the ranks' reduction sorts them)."""
    return [c for c in CHOICES if c in row]


def table(results: dict[str, Any], np_: int, repeats: int) -> str:
    """The table of a run (``results``: per link speed, per model, sync and compute times),
    as the compression page shows it."""
    lines = [
        f"# {np_} ranks, UCX over TCP on loopback, medians of {repeats} rounds",
        f"{'model':>6} {'link':>7} {'choice':>7} {'sync ms':>9} {'x full':>7} {'compute ms':>11}",
    ]
    for rate, models in results.items():
        for model, row in models.items():
            for choice in _ordered(row["sync"]):
                sync, compute = row["sync"][choice], row["compute"][choice]
                ratio = sync / row["sync"]["full"]
                lines.append(f"{model:>6} {rate:>7} {choice:>7} {sync * 1e3:9.2f} {ratio:7.3f} "
                             f"{compute * 1e3:11.2f}")  # fmt: skip
    if "1gbit" in results and "10gbit" in results:
        lines.append(
            "# link speed below which each choice's sync beats full width (t = a + b/rate)"
        )
        for model in results["1gbit"]:
            t1, t10 = results["1gbit"][model]["sync"], results["10gbit"][model]["sync"]
            a_f, b_f = _fit(t1["full"], t10["full"])
            for choice in _ordered(t1)[1:]:
                a_c, b_c = _fit(t1[choice], t10[choice])
                if a_c <= a_f:
                    verdict = "pays at every speed measured"
                elif b_f <= b_c:
                    verdict = "never pays"
                else:
                    verdict = f"pays below {(b_f - b_c) / (a_c - a_f):.1f} Gbit/s (fitted)"
                lines.append(f"{model:>6} {choice:>7}: {verdict}")
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> None:
    if args.table:  # reprint a saved run
        saved = json.loads(Path(args.table).read_text())
        print(table(saved["results"], saved["np"], saved["repeats"]))
        return
    signal.signal(signal.SIGTERM, lambda *_: (_unthrottle(), sys.exit(143)))
    signal.signal(signal.SIGINT, lambda *_: (_unthrottle(), sys.exit(130)))
    results = {}
    try:
        for rate in args.rates.split(","):
            results[rate] = _launch(rate, args)
    finally:
        _unthrottle()
    print(table(results, args.np, args.repeats))
    if args.out:
        import datetime
        from importlib import metadata

        saved = {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
            "jax": metadata.version("jax"),
            "np": args.np,
            "repeats": args.repeats,
            "results": results,
        }
        Path(args.out).write_text(json.dumps(saved, indent=1))


# -- the worker: every rank times the updates -----------------------------------------------


def _models(names: list[str]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_xla import residual_params

    out = {}
    if "25M" in names:
        keys = jax.random.split(jax.random.key(0), 6)
        out["25M"] = {
            f"layer{i}": {"w": jax.random.normal(k, (2048, 2048)) * 1e-2, "b": jnp.ones(2048)}
            for i, k in enumerate(keys)
        }
    if "mlp" in names:
        out["mlp"] = jax.tree.map(lambda x: x + 1e-2, residual_params(jax.random.key(1)))
    return out


def _compression(choice: str) -> Any:
    import jaxddp

    if choice == "full":
        return None
    if choice.startswith("psgd"):
        return jaxddp.PowerSGD(rank=int(choice[4:]))
    return choice


def _compute(choice: str, grads: Any, size: int) -> Any:
    """The arithmetic of ``choice`` on this rank, without the collectives: for bf16, the
    same handler over a communicator of this rank alone (on CPU, jaxddp's own); for
    PowerSGD, its products and orthonormalization."""
    import jax
    import jax.numpy as jnp

    leaves = jax.tree.leaves(grads)
    if choice == "full":
        return jax.jit(lambda t: t)
    if choice == "bf16":  # the narrow allreduce on this rank alone: its arithmetic
        from mpi4py import MPI

        from jaxddp._collectives._jax import ops

        residual = jnp.zeros(sum(x.size for x in leaves), jnp.float32)
        narrow = jax.jit(
            lambda t, r: ops.narrow_allreduce(
                jax.tree.leaves(t), r, jnp.bfloat16, True, MPI.COMM_SELF
            )
        )
        return lambda t: narrow(t, residual)
    r = int(choice[4:])
    qs = [
        jnp.ones((int(x.size // x.shape[0]), min(r, x.shape[0])), jnp.float32)
        for x in leaves
        if x.ndim >= 2 and (x.shape[0] + x.size // x.shape[0]) * r * 2 <= x.size
    ]

    def power(t: Any) -> Any:
        mats = [x.reshape(x.shape[0], -1) for x in jax.tree.leaves(t) if x.ndim >= 2]
        mats = [m for m in mats if (m.shape[0] + m.shape[1]) * r * 2 <= m.size]
        out = []
        for m, q in zip(mats, qs, strict=True):
            p = jnp.linalg.qr(m @ q, mode="reduced")[0]
            qn = m.T @ p
            out.append(m - p @ qn.T)
        return out

    return jax.jit(power)


def worker(args: argparse.Namespace) -> None:
    import jax

    import jaxddp
    from benchmarks.bench_allreduce import interleaved

    size = jaxddp.world_size()
    results = {}
    for model, grads in _models(args.models.split(",")).items():
        sync, compute = {}, {}
        for choice in ["full", *[c for c in args.choices.split(",") if c != "full"]]:
            tx = jaxddp.allreduce_gradients(compression=_compression(choice))
            state = tx.init(grads)
            update = jax.jit(tx.update)
            sync[choice] = lambda u=update, s=state, g=grads: jax.block_until_ready(u(g, s))
            local = _compute(choice, grads, size)
            compute[choice] = lambda f=local, g=grads: jax.block_until_ready(f(g))
        timed = interleaved(sync, warmup=2, repeats=args.repeats)
        local_times = interleaved(compute, warmup=2, repeats=args.repeats)
        # every rank's median, the slowest taken: a sync ends when its last rank is done
        timed = jaxddp.allreduce(timed, op="max")
        local_times = jaxddp.allreduce(local_times, op="max")
        results[model] = {
            "sync": {k: float(v) for k, v in timed.items()},
            "compute": {k: float(v) for k, v in local_times.items()},
            "parameters": sum(x.size for x in jax.tree.leaves(grads)),
        }
    if jaxddp.rank() == 0:
        Path(args.out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rates", default="1gbit,10gbit,none", help="tbf rates; none: no tc")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="25M,mlp")
    parser.add_argument("--choices", default=",".join(CHOICES), help="full always runs")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per launch")
    parser.add_argument("--out", default=None, help="save the run (JSON) here")
    parser.add_argument("--table", default=None, help="reprint a run saved with --out")
    args = parser.parse_args()
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
