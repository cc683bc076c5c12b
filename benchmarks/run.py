"""Runs the whole benchmark suite and writes JSON, a PNG plot and a markdown table.

    python benchmarks/run.py [--quick] [--results benchmarks/results] [--docs docs/benchmarks]

Each MPI benchmark is its own ``mpiexec`` launch, with a timeout; every launch measures the
limit (mpi4py's flat-buffer Allreduce) beside what it compares, so each ratio is taken
against a baseline measured in the same run. ``nox -s bench`` calls this.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
ORDER = ["limit", "jit_nompi", "jit_floor", "jaxddp", "mpi4jax_per_leaf", "mpi4jax_concat",
         "jax_gloo", "jax_gloo_flat", "torch_gloo"]  # fmt: skip
LABELS = {
    "limit": "mpi4py flat Allreduce (the limit)",
    "jit_nompi": "jit, no MPI: x*2 per leaf (JAX's floor)",
    "jit_floor": "jit holding one MPI op: x*2 per leaf (mpi4jax's floor)",
    "jaxddp": "jaxddp allreduce_gradients, jit",
    "mpi4jax_per_leaf": "mpi4jax, one call per leaf, jit",
    "mpi4jax_concat": "mpi4jax, concat -> 1 call -> split, jit",
    "jax_gloo": "JAX gloo, psum of the tree",
    "jax_gloo_flat": "JAX gloo, psum of one flat buffer",
    "torch_gloo": "torch gloo, flat all_reduce",
}


def mpi_run(np_: int, script: str, args: list[str], timeout: float) -> None:
    command = [MPIEXEC, "-n", str(np_), sys.executable, str(HERE / script), *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, timeout=timeout, cwd=ROOT)


def import_cost(repeats: int) -> dict[str, float]:
    def median_wall(code: str) -> float:
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    base = median_wall("import jax, optax")
    ours = median_wall("import jaxddp")
    return {"import_jax_optax_s": base, "import_jaxddp_s": ours, "ratio": ours / base}


def table(rows: list[dict], ranks: int) -> str:
    payloads: dict[str, dict] = {}
    for row in rows:
        if row["ranks"] == ranks:
            payloads.setdefault(row["payload"], {})[row["impl"]] = row
    impls = [i for i in ORDER if any(i in p for p in payloads.values())]
    head = "| payload | " + " | ".join(LABELS[i] for i in impls) + " |"
    lines = [head, "|---" * (len(impls) + 1) + "|"]
    for payload, by_impl in payloads.items():
        first = next(iter(by_impl.values()))
        cells = [f"{payload} ({first['leaves']} leaves, {first['bytes'] / 1e6:.3g} MB)"]
        for impl in impls:
            row = by_impl.get(impl)
            if row is None:
                cells.append("—")
            elif impl == "limit":
                cells.append(f"{row['median_s'] * 1e3:.3g} ms")
            else:
                cells.append(f"{row['median_s'] * 1e3:.3g} ms ({row['ratio']:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    payloads = sorted({r["payload"] for r in rows}, key=lambda p: _size(rows, p))
    colors = {impl: f"C{i}" for i, impl in enumerate(ORDER)}
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(13, 5))
    for ranks, style in ((2, "-o"), (4, "--s")):
        for impl in ORDER:
            pts = {r["payload"]: r for r in rows if r["impl"] == impl and r["ranks"] == ranks}
            if not pts:
                continue
            xs = [i for i, p in enumerate(payloads) if p in pts]
            label = f"{LABELS[impl]} ({ranks} ranks)"
            times = [pts[payloads[i]]["median_s"] * 1e3 for i in xs]
            ax_t.plot(xs, times, style, color=colors[impl], label=label)
            if impl != "limit":
                ratios = [pts[payloads[i]]["ratio"] for i in xs]
                ax_r.plot(xs, ratios, style, color=colors[impl], label=label)
    names = [f"{p}\n{_size(rows, p) / 1e6:.3g} MB" for p in payloads]
    for ax in (ax_t, ax_r):
        ax.set_xticks(range(len(payloads)), names, fontsize=8)
        ax.set_yscale("log")
    ax_t.set(ylabel="median time (ms)", title="Gradient allreduce")
    ax_r.set(ylabel="time / limit", title="Ratio to mpi4py's flat Allreduce (the limit)")
    ax_r.axhline(1.0, color="grey", lw=0.8)
    ax_t.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _size(rows: list[dict], payload: str) -> int:
    return next(r["bytes"] for r in rows if r["payload"] == payload)


def markdown(results: dict) -> str:
    parts = [
        "## Results",
        "",
        (
            f"Measured by `nox -s bench` on {results['machine']}. Medians; in brackets the ratio "
            "to mpi4py's Allreduce of one flat buffer of the same size, measured in the same "
            "launch. Lower is better."
        ),
        "",
    ]
    for ranks in sorted({r["ranks"] for r in results["allreduce"]}):
        parts += [
            f"### Gradient allreduce, {ranks} ranks",
            "",
            table(results["allreduce"], ranks),
            "",
        ]
    parts += ["![allreduce](allreduce.png)", ""]
    for step in results.get("step", []):
        parts += [
            f"### Train step, {step['ranks']} ranks",
            "",
            (
                "Forward, backward and adam in one jitted step, with "
                "`allreduce_gradients()` chained in and without it. The many-leaf models have "
                "a deliberately cheap loss, so the step is mostly per-leaf overhead; `flat` "
                "means the parameters were raveled into one vector by "
                "`jax.flatten_util.ravel_pytree`."
            ),
            "",
            "| model | state | step without sync | step with sync | what sync costs |",
            "|---|---|---|---|---|",
            *(
                f"| {c['model']} | {c['layout']} | {c['without_sync_s'] * 1e3:.3g} ms "
                f"| {c['with_sync_s'] * 1e3:.3g} ms | {c['sync_s'] * 1e3:.3g} ms "
                f"({c['communication_share']:.0%} of the step) |"
                for c in step["cases"]
            ),
            "",
        ]
    if "sampler" in results:
        s = results["sampler"]
        parts += [
            "### Sampler",
            "",
            (
                "One epoch's indices for one of 4 replicas, against "
                "`numpy.random.default_rng(seed).permutation(N)` (target: at most "
                f"{s['target_ratio']}x):"
            ),
            "",
            "| N | numpy permutation | DistributedSampler | ratio |",
            "|---|---|---|---|",
            *(
                f"| {c['n']:,} | {c['baseline_median_s']:.3f} s | {c['sampler_median_s']:.3f} s "
                f"| {c['ratio']:.2f}x |"
                for c in s["cases"]
            ),
            "",
        ]
    imp = results["import"]
    parts += [
        "### Import",
        "",
        (
            f"`import jaxddp` {imp['import_jaxddp_s'] * 1e3:.0f} ms against "
            f"`import jax, optax` {imp['import_jax_optax_s'] * 1e3:.0f} ms "
            f"({imp['ratio']:.2f}x; the guard and loading libmpi are the difference)."
        ),
        "",
    ]
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--docs", type=Path, default=None, help="also copy md + png here")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, 2 ranks only")
    args = parser.parse_args()
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    repeats = ["--repeats", "5" if args.quick else "15"]
    launches = [(2, "limit,jaxddp,mpi4jax_per_leaf,mpi4jax_concat,jit_nompi,jit_floor", "main")]
    launches.append((2, "limit,jax_gloo,jax_gloo_flat", "jaxgloo"))
    if importlib.util.find_spec("torch") is not None:
        launches.append((2, "limit,torch_gloo", "torch"))
    else:
        print("torch is not installed: torch gloo skipped (pip install torch==2.13.0)")
    if not args.quick:
        launches.append((4, "limit,jaxddp,mpi4jax_per_leaf", "main"))
    rows: list[dict] = []
    for np_, impls, tag in launches:
        part = out / f"allreduce-{tag}-np{np_}.json"
        mpi_run(np_, "bench_allreduce.py", ["--impls", impls, "--out", str(part), *repeats], 900)
        part_rows = json.loads(part.read_text())["rows"]
        limits = {r["payload"]: r["median_s"] for r in part_rows if r["impl"] == "limit"}
        for r in part_rows:
            r["ratio"] = r["median_s"] / limits[r["payload"]]
            if r["impl"] != "limit" or tag == "main":
                rows.append(r)
    steps = []
    for np_ in (2,) if args.quick else (2, 4):
        part = out / f"step-np{np_}.json"
        mpi_run(np_, "bench_step.py", ["--out", str(part)], 600)
        steps.append(json.loads(part.read_text()))
    results = {
        "machine": f"{os.cpu_count()} cores, Python {sys.version.split()[0]}",
        "allreduce": rows,
        "step": steps,
        "import": import_cost(3 if args.quick else 7),
    }
    sampler = HERE / "bench_sampler.py"
    if sampler.exists():
        sampler_json = out / "sampler.json"
        command = [sys.executable, str(sampler), "--out", str(sampler_json)]
        subprocess.run(command, check=True, timeout=900, cwd=ROOT)
        results["sampler"] = json.loads(sampler_json.read_text())
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(rows, out / "allreduce.png")
    (out / "results.md").write_text(markdown(results))
    print((out / "results.md").read_text())
    if args.docs:
        args.docs.mkdir(parents=True, exist_ok=True)
        (args.docs / "results.md").write_text(markdown(results))
        (args.docs / "allreduce.png").write_bytes((out / "allreduce.png").read_bytes())


if __name__ == "__main__":
    main()
