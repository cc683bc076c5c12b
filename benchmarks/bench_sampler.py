"""One epoch's indices of DistributedSampler against numpy's permutation, in one run.

    python benchmarks/bench_sampler.py            # N = 10,000,000, 4 replicas
    python benchmarks/bench_sampler.py --check    # exits 1 when over the 1.2x target

The baseline is ``numpy.random.default_rng(seed).permutation(N)``, the least any shuffled
sampler must do. A sample of the sampler is one rank's whole epoch: building the sampler,
``set_epoch`` and ``indices()`` (which returns a copy of the rank's shard), for a new epoch
each time so that nothing is cached; the rank cycles through all of them. Baseline and
sampler alternate, so drift on a shared machine hits both alike; the figures are medians.
A second case, N + 1, has padding (the order wraps around).

Memory is measured separately with tracemalloc (numpy reports its buffers to it): the peak
while one rank computes its epoch, and the peak while it then iterates over all its batches,
which must not grow with N.

Writes the figures to ``benchmarks/results/sampler.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxddp import DistributedSampler

TARGET = 1.2


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(n: int, replicas: int, repeats: int, seed: int) -> dict[str, object]:
    """Alternating samples of the baseline and of one rank's epoch; medians and ratio."""
    baseline: list[float] = []
    sampler: list[float] = []

    def baseline_once() -> None:
        np.random.default_rng(seed).permutation(n)

    def sampler_once(epoch: int) -> None:
        s = DistributedSampler(n, num_replicas=replicas, rank=epoch % replicas, seed=seed)
        s.set_epoch(epoch)
        s.indices()

    baseline_once()  # warm-up: page in numpy's code and the allocator
    sampler_once(0)
    for i in range(repeats):
        # alternate which goes first, so that neither always follows the other
        if i % 2:
            sampler.append(seconds(lambda i=i: sampler_once(i + 1)))
            baseline.append(seconds(baseline_once))
        else:
            baseline.append(seconds(baseline_once))
            sampler.append(seconds(lambda i=i: sampler_once(i + 1)))
    b, s = statistics.median(baseline), statistics.median(sampler)
    return {
        "n": n,
        "replicas": replicas,
        "padding": -n % replicas,
        "baseline_median_s": b,
        "sampler_median_s": s,
        "ratio": s / b,
        "baseline_samples_s": baseline,
        "sampler_samples_s": sampler,
    }


def memory(n: int, replicas: int, seed: int, batch_size: int) -> dict[str, object]:
    """Peak bytes traced while computing one rank's epoch, then while iterating its batches."""
    sampler = DistributedSampler(n, num_replicas=replicas, rank=replicas - 1, seed=seed)
    tracemalloc.start()
    sampler.indices()  # computes and caches the rank's shard, then copies it
    _, epoch_peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    before, _ = tracemalloc.get_traced_memory()
    batches = 0
    for _ in sampler.batches(batch_size):
        batches += 1
    _, batches_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "epoch_peak_bytes": epoch_peak,
        "epoch_peak_bytes_per_sample": epoch_peak / n,
        "batch_size": batch_size,
        "batches": batches,
        "batches_peak_above_start_bytes": batches_peak - before,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000_000)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("results") / "sampler.json"
    )
    parser.add_argument("--check", action="store_true", help=f"exit 1 when over {TARGET}x")
    args = parser.parse_args()

    cases = [
        compare(args.n, args.replicas, args.repeats, args.seed),
        compare(args.n + 1, args.replicas, args.repeats, args.seed),
    ]
    mem = memory(args.n, args.replicas, args.seed, args.batch_size)

    print(f"one epoch's indices, {args.replicas} replicas, median of {args.repeats}")
    print(
        f"{'N':>12} {'padding':>8} {'numpy permutation':>18} {'DistributedSampler':>19} {'ratio':>6}"
    )
    for c in cases:
        print(
            f"{c['n']:>12,} {c['padding']:>8} {c['baseline_median_s']:>16.4f} s "
            f"{c['sampler_median_s']:>17.4f} s {c['ratio']:>6.3f}"
        )
    print(f"target: ratio <= {TARGET}")
    print(
        f"memory: peak {mem['epoch_peak_bytes'] / 2**20:.1f} MiB while computing one rank's "
        f"epoch ({mem['epoch_peak_bytes_per_sample']:.1f} bytes per sample of N); "
        f"{mem['batches_peak_above_start_bytes'] / 2**10:.1f} KiB more at most while "
        f"iterating its {mem['batches']} batches of {mem['batch_size']}"
    )

    worst = max(float(c["ratio"]) for c in cases)  # type: ignore[arg-type]
    record = {
        "benchmark": "sampler",
        "target_ratio": TARGET,
        "worst_ratio": worst,
        "within_target": worst <= TARGET,
        "cases": cases,
        "memory": mem,
        "repeats": args.repeats,
        "seed": args.seed,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if args.check and worst > TARGET else 0


if __name__ == "__main__":
    sys.exit(main())
