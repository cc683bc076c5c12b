"""What an MPI collective costs when its rank's core is busy with something else.

    python benchmarks/bench_core_sharing.py [--np 2] [--repeats 300] [--out FILE]

Inside a jitted step, jaxddp's allreduce runs on XLA's compute thread while the Python
thread goes on with the framework's own work (Flax NNX spends ~12 ms per step after the
launch on this machine). With one core per rank (``mpiexec -bind-to core``, Open MPI's
default) the two threads share it, and MPI's waits spin: each step of the collective's
protocol that needs the other rank waits until the scheduler gives that rank's compute thread
the core again, a time slice of the busy thread (milliseconds). This benchmark shows that
without JAX: ``mpi4py``'s ``Allreduce`` on one core per rank, timed alone and with a CPU hog
(a child process spinning in Python, on the rank's own core, as the Python thread is) beside
it, for 4 bytes and for the 100-leaf NNX model's gradients (0.42 MB), under MPICH's default
waits and under its sleeping waits (``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``: a nanosleep instead of
``sched_yield`` between polls, so the waiting thread gives the core back at once and is woken
with a sleeper's priority). Each case is its own ``mpiexec`` launch with a timeout; each call
follows a barrier, so what is timed is the collective with ranks lined up. Per case, the
median over ranks of each rank's median. A third setting waits with ``MPI_Test`` on
``MPI_Iallreduce`` (and ``MPI_Ibarrier``): MPICH's blocking wait under
``MPI_THREAD_MULTIPLE`` calls ``sched_yield`` between polls (``strace -c``: ~6000 calls in
320 allreduces), which hands the core to the other thread for a whole slice; ``MPI_Test``
never yields.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = {"4 B": 1, "0.42 MB": 105674}  # float32 elements: a scalar; the 100-leaf gradients
# Each setting: the environment of the launch, and whether the ranks wait with MPI_Test on a
# nonblocking call (Ibarrier, Iallreduce) instead of in the blocking one, as jaxddp's own
# allreduce handler does (jaxddp/_native; there the wait also naps, which a spinning
# process beside it would not show).
SETTINGS = {
    "default waits": ({}, False),
    "sleeping waits": ({"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}, False),
    "MPI_Test polls": ({}, True),
}


def worker(elements: int, repeats: int, hog: bool, polls: bool) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    spinner = None
    if hog:  # inherits this rank's binding: it shares the rank's core
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.2)
    try:
        send = np.ones(elements, np.float32)
        recv = np.empty_like(send)

        def wait(request: MPI.Request) -> None:
            while not request.Test():
                pass

        barrier = (lambda: wait(comm.Ibarrier())) if polls else comm.Barrier
        allreduce = (
            (lambda: wait(comm.Iallreduce(send, recv)))
            if polls
            else (lambda: comm.Allreduce(send, recv))
        )
        for _ in range(20):
            allreduce()
        times = []
        for _ in range(repeats):
            barrier()
            start = time.perf_counter()
            allreduce()
            times.append(time.perf_counter() - start)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    medians = comm.gather(statistics.median(times))
    if comm.rank == 0:
        print(json.dumps({"median_s": statistics.median(medians), "rank_medians_s": medians}))


def launch(
    np_: int, elements: int, repeats: int, *, hog: bool, env: dict[str, str], polls: bool
) -> dict:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    command = [mpiexec, "-bind-to", "core", "-n", str(np_), sys.executable, __file__]
    command += ["--worker", str(elements), "--repeats", str(repeats)]
    command += (["--hog"] if hog else []) + (["--polls"] if polls else [])
    env = {**os.environ, **env}
    out = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        message = f"{' '.join(command)} exited {out.returncode}:\n{out.stderr[-2000:]}"
        raise RuntimeError(message)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hog", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--polls", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.repeats, args.hog, args.polls)
        return
    rows = []
    for setting, (env, polls) in SETTINGS.items():
        for size, elements in SIZES.items():
            row = {"setting": setting, "size": size}
            for hog in (False, True):
                row["busy core" if hog else "idle core"] = launch(
                    args.np, elements, args.repeats, hog=hog, env=env, polls=polls
                )["median_s"]
            rows.append(row)
            print(
                f"{setting:>15} {size:>8}: idle core {row['idle core'] * 1e3:8.3f} ms, "
                f"busy core {row['busy core'] * 1e3:8.3f} ms",
                flush=True,
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"ranks": args.np, "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
