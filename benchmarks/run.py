"""Runs the whole benchmark suite and writes JSON, PNG plots and the All results page.

    python benchmarks/run.py [--quick] [--only SECTIONS] [--results benchmarks/results]
                             [--docs docs/benchmarks]

Each MPI benchmark is its own ``mpiexec`` launch, with a timeout; every launch measures the
limit (mpi4py's flat-buffer Allreduce) beside what it compares, so each ratio is taken
against a baseline measured in the same run. ``nox -s bench`` calls this.

``--only nnx-step,eager`` runs some sections (see SECTIONS) and takes the others from the
``results.json`` a previous run left in ``--results``, if any, before writing the pages;
``--only ''`` runs nothing and writes the page again from that file. The page is
``results.md`` (``docs/benchmarks/results.md`` with ``--docs``): every table of the run, each
under a short caption; the Methods page (``docs/benchmarks/methods.md``) defines the columns,
and the Benchmarks page (``docs/benchmarks/index.md``, written by hand) picks the latest
figures from this and other runs.
The collective-path comparisons (``nnx-step``, ``eager``) launch each benchmark twice: as
installed (the fast path) and with ``JAXDDP_TEST_COLLECTIVE_PATH=ordered`` (the ordered-effect
path jaxddp used before, and still falls back to where the fast path is not proven).
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


SECTIONS = (
    "allreduce", "peers", "step", "nnx-step", "eager", "sampler", "import", "checkpoint", "join",
    "xla",
)  # fmt: skip
PEERS = frozenset({"jax_gloo", "jax_gloo_flat", "torch_gloo"})
PATHS = ("fast", "ordered")  # values of JAXDDP_TEST_COLLECTIVE_PATH
# the target for the three residual MLPs: at 2 ranks a step's sync costs at most 3x the limit
TARGET_SYNC_IN_LIMITS = 3.0


def mpi_run(
    np_: int,
    script: str,
    args: list[str],
    timeout: float,
    path: str | None = None,
    *,
    extra_env: dict[str, str] | None = None,
) -> None:
    # Each rank bound to a core (Open MPI's default; MPICH's mpiexec binds nothing unless
    # told): unbound ranks move between the two cores and their steps' spread grows, which
    # a synchronous step pays for. 2026-12-01, the 100-leaf NNX step on jax 0.12: sync added
    # 3.43x the limit unbound, 1.6-3.4x in five of six runs bound
    # (benchmarks/results/HISTORY.md).
    command = [MPIEXEC, "-bind-to", "core", "-n", str(np_), sys.executable]
    command += [str(HERE / script), *args]
    env = {**os.environ, **(extra_env or {})}
    if path is not None:
        env["JAXDDP_TEST_COLLECTIVE_PATH"] = path
    said = " ".join(f"{k}={v}" for k, v in (extra_env or {}).items())
    print("+", f"JAXDDP_TEST_COLLECTIVE_PATH={path}" if path else said, " ".join(command))
    sys.stdout.flush()
    subprocess.run(command, check=True, timeout=timeout, cwd=ROOT, env=env)


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
        "# All results",
        "",
        (
            "The tables of the `nox -s bench` runs kept in benchmarks/results/ (a run of some "
            "sections keeps the others' earlier results, so tables may come from different "
            f"runs); the last run on {results['machine']}. Medians; in "
            "brackets the ratio to the limit (mpi4py's `Allreduce` of one flat buffer of the "
            "same bytes, measured in the same launch). Lower is better. [Methods](methods.md) "
            "says how each was measured; the [Benchmarks](index.md) page has the latest figures."
        ),
        "",
    ]
    for ranks in sorted({r["ranks"] for r in results.get("allreduce", [])}):
        parts += [
            f"## Gradient allreduce, {ranks} ranks",
            "",
            table(results["allreduce"], ranks),
            "",
        ]
    if results.get("allreduce"):
        parts += ["![Gradient allreduce against the limit, by payload](allreduce.png)", ""]
    if results.get("nnx_step"):
        parts += nnx_step_markdown(results["nnx_step"])
    if results.get("eager"):
        parts += eager_markdown(results["eager"])
    if results.get("checkpoint"):
        parts += checkpoint_markdown(results["checkpoint"])
    if results.get("checkpoint-loop"):
        parts += checkpoint_loop_markdown(results["checkpoint-loop"])
    if results.get("sharded-checkpoint"):
        parts += sharded_checkpoint_markdown(results["sharded-checkpoint"])
    if results.get("join"):
        parts += join_markdown(results["join"])
    if results.get("xla"):
        parts += xla_markdown(results["xla"])
    for step in results.get("step", []):
        parts += [
            f"## Train step, {step['ranks']} ranks",
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
            "## Sampler",
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
    if "import" in results:
        imp = results["import"]
        parts += [
            "## Import",
            "",
            (
                f"`import jaxddp` {imp['import_jaxddp_s'] * 1e3:.0f} ms against "
                f"`import jax, optax` {imp['import_jax_optax_s'] * 1e3:.0f} ms "
                f"({imp['ratio']:.2f}x; the guard and loading libmpi are the difference)."
            ),
            "",
        ]
    return "\n".join(parts)


def _by_ranks_and_path(parts: list[dict]) -> dict[int, dict[str, dict]]:
    found: dict[int, dict[str, dict]] = {}
    for part in parts:
        found.setdefault(part["ranks"], {})[part["path"]] = part
    return dict(sorted(found.items()))


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} µs" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def _sync_cell(case: dict) -> str:
    return f"{case['sync_s'] * 1e3:.3g} ms ({case['sync_in_limits']:.3g}x)"


def _floor_cells(case: dict | None) -> str:
    if not case or "floor_sync_s" not in case:  # results of a run before the sync point
        return "— | —"
    return f"{case['floor_sync_s'] * 1e3:.3g} ms | {case['beyond_floor_in_limits']:.3g}x"


def nnx_step_markdown(parts: list[dict]) -> list[str]:
    lines = [
        "## Train step, Flax NNX",
        "",
        (
            "The three residual MLPs of the step benchmark (`nnx.Linear(32, width)`, `blocks` x "
            "`x + LayerNorm(relu(Linear(width, width)(x)))`, `nnx.Linear(width, 10)`) as the "
            "Flax docs train them: `nnx.Optimizer` and one `nnx.jit` step, `optax.adam(1e-3)` "
            "alone and chained after `jaxddp.allreduce_gradients()`, "
            f"{parts[0]['batch_per_rank']} samples per rank, {parts[0]['repeats']} rounds. "
            "*Sync adds*: median(step with sync) - median(step alone), in brackets in units of "
            "the limit; *a sync point* and the two paths are defined in "
            "[Methods](methods.md#train-steps). Each path is its own launch; the step alone and "
            "the limit shown are the fast launch's. Target at 2 ranks: at most "
            f"{TARGET_SYNC_IN_LIMITS:g}x the limit."
        ),
        "",
    ]
    for ranks, by_path in _by_ranks_and_path(parts).items():
        fast, ordered = by_path.get("fast"), by_path.get("ordered")
        lines += [
            f"### {ranks} ranks",
            "",
            (
                "| model | param leaves | grad bytes | step alone | the limit "
                "| sync adds, fast path | a sync point adds | beyond it "
                "| sync adds, ordered path (before) |"
            ),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        models = [c["model"] for c in (fast or ordered)["cases"]]
        for i, model in enumerate(models):
            f = fast["cases"][i] if fast else None
            o = ordered["cases"][i] if ordered else None
            base = f or o
            lines.append(
                f"| {model} | {base['param_leaves']} | {base['grad_bytes'] / 1e6:.2f} MB "
                f"| {base['alone_s'] * 1e3:.3g} ms | {base['limit_s'] * 1e3:.3g} ms "
                f"| {_sync_cell(f) if f else '—'} | {_floor_cells(f)} "
                f"| {_sync_cell(o) if o else '—'} |"
            )
        lines.append("")
    lines += ["![Flax NNX train step: what sync adds](nnx-step.png)", ""]
    return lines


def plot_nnx_step(parts: list[dict], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = _by_ranks_and_path(parts)
    fig, axes = plt.subplots(1, len(grouped), figsize=(6 * len(grouped), 4.5), squeeze=False)
    floor = 0.05  # a median difference at or below zero is noise; drawn at the floor
    for ax, (ranks, by_path) in zip(axes[0], grouped.items(), strict=True):
        models = [c["model"] for c in next(iter(by_path.values()))["cases"]]
        width = 0.38
        for j, name in enumerate(PATHS):
            if name not in by_path:
                continue
            values = [c["sync_in_limits"] for c in by_path[name]["cases"]]
            xs = [i + (j - 0.5) * width for i in range(len(models))]
            label = "fast path" if name == "fast" else "ordered path (before)"
            bars = ax.bar(xs, [max(v, floor) for v in values], width, label=label, color=f"C{j}")
            for bar, v in zip(bars, values, strict=True):
                text = f"{v:.3g}x" if v > floor else f"{v:.2g}x (noise)"
                ax.annotate(text, (bar.get_x() + width / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)  # fmt: skip
        fast = by_path.get("fast")
        if fast and all("beyond_floor_in_limits" in c for c in fast["cases"]):
            ax.scatter(
                [i - 0.5 * width for i in range(len(models))],
                [max(c["beyond_floor_in_limits"], floor) for c in fast["cases"]],
                marker="D", color="k", s=18, zorder=3,
                label="fast path, beyond a 4-byte sync point",
            )  # fmt: skip
        ax.axhline(TARGET_SYNC_IN_LIMITS, color="grey", ls="--", lw=0.8, label="target (3x)")
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor * 0.8)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        ax.set_xticks(range(len(models)), [m.replace(", ", "\n") for m in models], fontsize=8)
        ax.set(ylabel="sync adds / the limit", title=f"NNX train step, {ranks} ranks")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def checkpoint_markdown(parts: list[dict]) -> list[str]:
    lines = [
        "## Checkpoints",
        "",
        (
            "A save of a training state (parameters, Adam's two moments, a sampler state, a "
            "step counter) until it is complete on disk: `jaxddp.CheckpointManager.save` on "
            "every rank (rank 0 writes) against Orbax's own `CheckpointManager` in one process. "
            "Target: at most 1.2x. *Checksums*: the CRC-32 of every array, timed alone in the "
            "same rounds (target: at most 10% of the save)."
        ),
        "",
        "| ranks | state | Orbax, one process | jaxddp, every rank | ratio | checksums |",
        "|---|---|---|---|---|---|",
    ]
    for m in parts:
        crc = (
            f"{m['checksums_s'] * 1e3:.0f} ms ({m['checksums_share']:.0%} of the save)"
            if "checksums_s" in m
            else "not measured"
        )
        lines.append(
            f"| {m['ranks']} | {m['bytes'] / 1e6:.0f} MB | {m['orbax_s'] * 1e3:.0f} ms "
            f"| {m['jaxddp_s'] * 1e3:.0f} ms | {m['ratio']:.2f}x | {crc} |"
        )
    lines += [
        "",
        (
            "A background `save` (the default) returns once every rank holds a host copy; the "
            "ranks' comparison (fingerprints, one allgather) and the write go on in a thread. "
            "Targets: it returns in at most 10% of the blocking save above, and a loop saving "
            "every K steps costs at most 1.05x the same loop without saves. *Fingerprints*: "
            "one rank's, of its host copy, on that thread; *unchecked*: the loop with the "
            "comparison left out (what the check costs the loop)."
        ),
        "",
        "| ranks | background `save` returns | fingerprints | K | loop | loop, unchecked |",
        "|---|---|---|---|---|---|",
    ]
    for m in parts:
        if "return_share" not in m:
            continue
        loop = (
            (f"{m['every']}", f"{m['loop_ratio']:.3f}x", f"{m['loop_ratio_unchecked']:.3f}x")
            if "loop_ratio" in m
            else ("-", "not measured", "not measured")
        )
        lines.append(
            f"| {m['ranks']} | {m['background_returns_s'] * 1e3:.0f} ms "
            f"({m['return_share']:.1%}) | {m['fingerprints_s'] * 1e3:.0f} ms | "
            + " | ".join(loop)
            + " |"
        )
    return [*lines, ""]


def checkpoint_loop_markdown(parts: list[dict]) -> list[str]:
    lines = [
        "### Saving while training",
        "",
        (
            "A loop of jitted steps that updates the whole state in place (donated) and saves "
            "it every K steps, against the same loop without saves: `save` in the background "
            "(the default) and blocking (`background=False`). Per step, medians over rounds; "
            "the background period ends when its write does. Targets: the background loop at "
            "most 1.05x the loop without saves; its `save` returning in at most 10% of the "
            "blocking save's time."
        ),
        "",
        (
            "| ranks | state | K | step, no saves | background | blocking "
            "| background `save` returns | blocking `save` |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in parts:
        step, ratio, ret = m["step_s"], m["loop_ratio"], m["save_returns_s"]
        lines.append(
            f"| {m['ranks']} | {m['bytes'] / 1e6:.0f} MB | {m['every']} "
            f"| {step['none'] * 1e3:.1f} ms | {ratio['background']:.2f}x "
            f"| {ratio['blocking']:.2f}x | {ret['background'] * 1e3:.0f} ms "
            f"({m['return_share']:.0%}) | {ret['blocking'] * 1e3:.0f} ms |"
        )
    return [*lines, ""]


def sharded_checkpoint_markdown(parts: list[dict]) -> list[str]:
    lines = [
        "### The sharded optimizer's state",
        "",
        (
            "`shard_optimizer(optax.adam)`'s state saved as it is (every rank writes its "
            "slices) against gathered first with `tx.gather_state` (every rank then holds the "
            "full state), each until complete on disk: the slowest rank's time, and the peak "
            "resident memory a save added on each rank (`VmHWM`)."
        ),
        "",
        (
            "| ranks | optimizer state | sliced | gathered | memory added per rank, sliced "
            "| gathered |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for m in parts:
        peaks = m["peak_added_bytes_per_rank"]
        sliced = max(p["sliced"] for p in peaks) / 1e6
        gathered = max(p["gathered"] for p in peaks) / 1e6
        lines.append(
            f"| {m['ranks']} | {m['optimizer_state_bytes'] / 1e6:.0f} MB "
            f"| {m['seconds']['sliced'] * 1e3:.0f} ms | {m['seconds']['gathered'] * 1e3:.0f} ms "
            f"| at most {sliced:.1f} MB | at most {gathered:.0f} MB |"
        )
    return [*lines, ""]


JOIN_TARGET_SHARE, JOIN_TARGET_S = 0.03, 50e-6  # at most 3% of the step and 50 us a step


def xla_markdown(parts: list[dict]) -> list[str]:
    lines = [
        "## JAX's own collectives (`JAXDDP_COLLECTIVES=xla`) against the MPI path",
        "",
        (
            "The same adam step in one launch: without sync, with `allreduce_gradients()` "
            "under `jax.jit` (the MPI path), in `jaxddp.spmd` (XLA's collectives: gloo on "
            "CPUs), and JAX's own multi-process program (one `jax.jit` over the ranks' mesh, "
            "replicated parameters fed back, the batch made global at each call). See the "
            "[XLA collectives](../xla.md) page."
        ),
        "",
        (
            "| ranks | JAX | model | no sync | MPI path | XLA path | JAX's own | limit "
            "| MPI path / no sync | XLA path / JAX's own |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for part in parts:
        for c in part["cases"]:
            cells = [c[k] * 1e3 for k in ("without_sync_s", "mpi_s", "xla_s", "own_s", "limit_s")]
            ratios = (c["mpi_s"] / c["without_sync_s"], c["xla_s"] / c["own_s"])
            lines.append(
                f"| {part['ranks']} | {part['jax']} | {c['model']} | "
                + " | ".join(f"{v:.2f} ms" for v in cells)
                + "".join(f" | {r:.2f}x" for r in ratios)
                + " |"
            )
    lines += [
        "",
        (
            "Dispatch: a step without communication (each f32[16] parameter leaf scaled and "
            "fed back, the loss a mean of the batch) per call: `jax.jit` on one rank's arrays, "
            "`jaxddp.spmd`, JAX's own program (whose loss, the global batch's mean, is one "
            "4-byte all-reduce)."
        ),
        "",
        "| ranks | JAX | leaves | `jax.jit`, one rank | `jaxddp.spmd` | JAX's own | spmd / own |",
        "|---|---|---|---|---|---|---|",
    ]
    for part in parts:
        for d in part.get("dispatch", []):
            cells = [d[k] * 1e3 for k in ("jit_s", "spmd_s", "own_s")]
            lines.append(
                f"| {part['ranks']} | {part['jax']} | {d['leaves']} | "
                + " | ".join(f"{v:.2f} ms" for v in cells)
                + f" | {d['spmd_s'] / d['own_s']:.2f}x |"
            )
    return [*lines, ""]


def join_markdown(parts: list[dict]) -> list[str]:
    lines = [
        "## Uneven streams: what `jaxddp.join` adds to a step",
        "",
        (
            "The plain `jax.jit` + optax step of the 20-leaf residual MLP (4 blocks of width "
            "256, 1.1 MB of gradients) in a loop over `jaxddp.join` of a per-rank stream and "
            "in the same loop over `DistributedSampler.batches`, alternating; medians of the "
            "per-round differences, in wall time and in CPU time of a rank. Target: at most 3% "
            "of the step and at most 50 us a step."
        ),
        "",
        (
            "| ranks | JAX | step over the sampler | join adds (wall) | share | join adds (CPU) "
            "| within target |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for m in parts:
        limit = min(JOIN_TARGET_S, JOIN_TARGET_SHARE * m["sampler_step_s"])
        lines.append(
            f"| {m['ranks']} | {m['jax']} | {m['sampler_step_s'] * 1e3:.2f} ms "
            f"| {m['join_adds_s'] * 1e6:.0f} us | {m['join_adds_share']:.1%} "
            f"| {m['join_adds_cpu_s'] * 1e6:.0f} us | {'yes' if m['join_adds_s'] <= limit else 'no'} |"
        )
    return [*lines, ""]


def eager_markdown(parts: list[dict]) -> list[str]:
    checked = any(k.endswith("_unchecked") for p in parts for k in p["medians_s"])
    head = (
        "| ranks | call | mpi4py, same bytes | least any API pays | jaxddp, eager "
        "| jit, fast path | jit, ordered path (before) |"
    )
    if checked:  # results of a run before the signature check have no unchecked calls
        head += " eager, no check | check costs |"
    lines = [
        "## Collectives outside jit",
        "",
        (
            '`jaxddp.allreduce` of `{"loss": jnp.float32, "accuracy": jnp.float32}` and '
            "`jaxddp.masked_mean` of 256 float32 values with a boolean mask (jax arrays in, "
            "NumPy out) against mpi4py's `Allreduce` of the bytes jaxddp sends (2 float32 for "
            "the metrics; 2 float64 for `masked_mean`: the masked sum and the count), taking "
            "turns in one launch; for contrast, the same calls under `jax.jit` on each "
            "collective path, each path its own launch. Target: eager at most 3x mpi4py. "
            "*Least any API pays* and the signature check are defined in "
            "[Methods](methods.md#collectives-outside-jit)"
            + (
                "; *no check* is the same call with `JAXDDP_CHECK=0`, in the same rounds "
                "(target for the check: at most 1.5x)."
                if checked
                else "."
            )
        ),
        "",
        head,
        "|---" * (head.count("|") - 1) + "|",
    ]
    calls = (
        ("allreduce", "`allreduce` of 2 float32 scalars", "limit_f32x2", "2 float32"),
        ("masked_mean", "`masked_mean`, 256 values", "limit_f64x2", "2 float64"),
    )
    for ranks, by_path in _by_ranks_and_path(parts).items():
        fast, ordered = by_path.get("fast"), by_path.get("ordered")
        base = fast or ordered
        for call, label, limit, sent in calls:
            m = base["medians_s"]

            def cell(part: dict | None, key: str, limit: str = limit) -> str:
                if part is None:
                    return "—"
                t, ref = part["medians_s"][key], part["medians_s"][limit]
                return f"{_us(t)} ({t / ref:.2f}x)"

            eager = cell(base, f"{call}_eager")
            if limit == "limit_f64x2":
                t, ref = m[f"{call}_eager"], m["limit_f32x2"]
                eager += f"; {t / ref:.2f}x the 8-byte buffer"
            least = cell(base, f"least_{call}") if f"least_{call}" in m else "—"
            bare = f"{call}_eager_unchecked"
            unchecked = cell(base, bare) if bare in m else "—"
            costs = f"{m[f'{call}_eager'] / m[bare]:.2f}x" if bare in m else "—"
            row = (
                f"| {ranks} | {label} | {_us(m[limit])} ({sent}) | {least} | {eager} "
                f"| {cell(fast, f'{call}_jit')} | {cell(ordered, f'{call}_jit')} |"
            )
            lines.append(row + (f" {unchecked} | {costs} |" if checked else ""))
    lines.append("")
    return lines


def run_allreduce(out: Path, quick: bool, sections: set[str]) -> list[dict]:
    repeats = ["--repeats", "5" if quick else "15"]
    launches = []
    if "allreduce" in sections:
        impls = "limit,jaxddp,mpi4jax_per_leaf,mpi4jax_concat,jit_nompi,jit_floor"
        launches.append((2, impls, "main"))
        if not quick:
            launches.append((4, "limit,jaxddp,mpi4jax_per_leaf", "main"))
    if "peers" in sections:
        launches.append((2, "limit,jax_gloo,jax_gloo_flat", "jaxgloo"))
        if importlib.util.find_spec("torch") is not None:
            launches.append((2, "limit,torch_gloo", "torch"))
        else:
            print("torch is not installed: torch gloo skipped (pip install torch==2.13.0)")
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
    return rows


def run_by_path(
    out: Path, script: str, name: str, args: list[str], ranks: tuple[int, ...]
) -> list[dict]:
    """One launch per rank count and collective path; the parsed JSON of each. Rank counts
    of 2 and 4 not in ``ranks`` keep the JSON of an earlier run, where there is one."""
    parts = []
    for np_ in (2, 4):
        for path in PATHS:
            part = out / f"{name}-{path}-np{np_}.json"
            if np_ in ranks:
                # 4 ranks of the NNX steps on 2 cores: three steps of three models, 41 rounds
                mpi_run(np_, script, [*args, "--out", str(part)], 1800, path=path)
            elif not part.exists():
                continue
            parts.append(json.loads(part.read_text()))
    return parts


def merge(old: dict, new: dict, sections: set[str]) -> dict:
    """``new``'s sections over ``old``'s, for a run of only some sections."""
    merged = {**old, **new}
    ran = sections & {"allreduce", "peers"}
    if "allreduce" in old and ran and ran != {"allreduce", "peers"}:
        keep = "peers" if "peers" not in sections else "allreduce"
        kept = [r for r in old["allreduce"] if (r["impl"] in PEERS) == (keep == "peers")]
        merged["allreduce"] = kept + new.get("allreduce", [])
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--docs", type=Path, default=None, help="also copy md + png here")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, 2 ranks only")
    parser.add_argument(
        "--ranks",
        default=None,
        help="rank counts the nnx-step and eager sections launch, e.g. '2' (default 2,4; "
        "2 with --quick); the others keep an earlier run's results",
    )
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)} ('': only write the pages again)",
    )
    args = parser.parse_args()
    ranks = tuple(int(r) for r in (args.ranks or ("2" if args.quick else "2,4")).split(","))
    sections = set(filter(None, args.only.split(",")))
    if unknown := sections - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": f"{os.cpu_count()} cores, Python {sys.version.split()[0]}"}
    if sections & {"allreduce", "peers"}:
        results["allreduce"] = run_allreduce(out, args.quick, sections)
    if "step" in sections:
        results["step"] = []
        for np_ in (2,) if args.quick else (2, 4):
            part = out / f"step-np{np_}.json"
            mpi_run(np_, "bench_step.py", ["--out", str(part)], 600)
            results["step"].append(json.loads(part.read_text()))
    if "nnx-step" in sections:
        repeats = ["--repeats", "11" if args.quick else "41"]
        results["nnx_step"] = run_by_path(out, "bench_nnx_step.py", "nnx-step", repeats, ranks)
    if "eager" in sections:
        repeats = ["--repeats", "101" if args.quick else "301"]
        results["eager"] = run_by_path(out, "bench_eager.py", "eager", repeats, ranks)
    if "import" in sections:
        results["import"] = import_cost(3 if args.quick else 7)
    if "checkpoint" in sections:
        results["checkpoint"] = []
        for np_ in (2,) if args.quick else (2, 4):
            part = out / f"checkpoint-np{np_}.json"
            repeats = ["--repeats", "3" if args.quick else "9"]
            mpi_run(np_, "bench_checkpoint.py", [*repeats, "--out", str(part)], 600)
            results["checkpoint"].append(json.loads(part.read_text()))
        results["checkpoint-loop"], results["sharded-checkpoint"] = [], []
        for np_ in (2,) if args.quick else (2, 4):
            part = out / f"checkpoint-loop-np{np_}.json"
            rounds = ["--rounds", "2" if args.quick else "5"]
            mpi_run(np_, "bench_checkpoint_loop.py", [*rounds, "--out", str(part)], 900)
            results["checkpoint-loop"].append(json.loads(part.read_text()))
            part = out / f"sharded-checkpoint-np{np_}.json"
            repeats = ["--repeats", "3" if args.quick else "7"]
            mpi_run(np_, "bench_sharded_checkpoint.py", [*repeats, "--out", str(part)], 600)
            results["sharded-checkpoint"].append(json.loads(part.read_text()))
    if "join" in sections:
        results["join"] = []
        for np_ in (2,) if args.quick else (2, 4):
            part = out / f"join-np{np_}.json"
            rounds = ["--rounds", "11" if args.quick else "31"]
            mpi_run(np_, "bench_join.py", [*rounds, "--out", str(part)], 600)
            results["join"].append(json.loads(part.read_text()))
    if "xla" in sections:
        results["xla"] = []
        for np_ in (2,) if args.quick else (2, 4):
            part = out / f"xla-np{np_}.json"
            repeats = ["--repeats", "15" if args.quick else "41"]
            xla = {"JAXDDP_COLLECTIVES": "xla"}
            mpi_run(np_, "bench_xla.py", [*repeats, "--out", str(part)], 900, extra_env=xla)
            results["xla"].append(json.loads(part.read_text()))
    sampler = HERE / "bench_sampler.py"
    if "sampler" in sections and sampler.exists():
        sampler_json = out / "sampler.json"
        command = [sys.executable, str(sampler), "--out", str(sampler_json)]
        subprocess.run(command, check=True, timeout=900, cwd=ROOT)
        results["sampler"] = json.loads(sampler_json.read_text())
    previous = out / "results.json"
    if sections != set(SECTIONS) and previous.exists():
        results = merge(json.loads(previous.read_text()), results, sections)
    previous.write_text(json.dumps(results, indent=1))
    pngs = []
    if results.get("allreduce"):
        plot(results["allreduce"], out / "allreduce.png")
        pngs.append("allreduce.png")
    if results.get("nnx_step"):
        plot_nnx_step(results["nnx_step"], out / "nnx-step.png")
        pngs.append("nnx-step.png")
    (out / "results.md").write_text(markdown(results))
    print((out / "results.md").read_text())
    if args.docs:
        args.docs.mkdir(parents=True, exist_ok=True)
        (args.docs / "results.md").write_text(markdown(results))
        for png in pngs:
            (args.docs / png).write_bytes((out / png).read_bytes())


if __name__ == "__main__":
    main()
