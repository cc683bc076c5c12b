"""Draws the plots of the Benchmarks page (docs/benchmarks/index.md) from its tables' figures.

    python benchmarks/plot_summary.py [--docs docs/benchmarks]

The page's figures come from several runs (``nox -s bench``, single benchmarks run alone, and
the comparison with PyTorch DDP timed outside the suite), so they are written here as the
page shows them, each with the run it comes from; ``benchmarks/results/HISTORY.md`` has the
runs. Change a figure here and on the page together. Needs matplotlib.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HERE = Path(__file__).resolve().parent

# What gradient sync adds to a plain jax.jit + optax step (PyTorch: DistributedDataParallel),
# 2 ranks, ms, 2026-12-04; (low, high) is the range of three runs.
STEP_SYNC_MS = {
    "models": ["4 x 256\n20 leaves, 1.1 MB", "24 x 64\n100 leaves, 0.42 MB",
               "100 x 32\n404 leaves, 0.45 MB"],
    "jaxddp, jax 0.10": [1.88, 1.79, (1.25, 4.15)],
    "jaxddp, jax 0.12": [1.12, 1.42, (3.29, 7.36)],
    "PyTorch DDP (gloo)": [6.80, 8.12, 12.3],
}  # fmt: skip

# One jitted allreduce of one float32 array, back to back, ranks bound to a core, 2026-12-03:
# payload bytes -> (the limit, jaxddp through shared memory, jaxddp through MPI), ms.
ALLREDUCE_MS = {
    2: {4e3: (0.010, 0.020, 0.029), 0.42e6: (0.18, 0.20, 0.44), 4e6: (1.8, 3.6, 6.4),
        16e6: (11.8, 15.7, 21.5), 64e6: (59, 89, 125)},
    4: {4e3: (0.06, 0.15, 3.7), 0.42e6: (0.65, 0.93, 6.6), 16e6: (39, 46, 60)},
}  # fmt: skip


def plot_step_sync(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [k for k in STEP_SYNC_MS if k != "models"]
    models = STEP_SYNC_MS["models"]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for j, name in enumerate(series):
        for i, value in enumerate(STEP_SYNC_MS[name]):
            x = i + (j - (len(series) - 1) / 2) * width
            low, high = value if isinstance(value, tuple) else (value, value)
            ax.bar(x, low, width, color=f"C{j}", label=name if i == 0 else None)
            if high > low:  # a range over runs: the bar to the lowest, a line to the highest
                ax.vlines(x, low, high, color=f"C{j}", lw=2.5)
                ax.annotate(f"{low:g}-{high:g}", (x, high), ha="center", va="bottom", fontsize=7)
            else:
                ax.annotate(f"{low:g}", (x, low), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(models)), models, fontsize=8)
    ax.set(ylabel="sync adds to a step (ms)", title="What gradient sync adds to a step, 2 ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_allreduce(path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for ranks, color in ((2, "C0"), (4, "C1")):
        sizes = sorted(ALLREDUCE_MS[ranks])
        for k, (label, style) in enumerate((("jaxddp", "-o"), ("jaxddp, through MPI", "--s"))):
            ratios = [ALLREDUCE_MS[ranks][s][k + 1] / ALLREDUCE_MS[ranks][s][0] for s in sizes]
            ax.plot(sizes, ratios, style, color=color, label=f"{label}, {ranks} ranks")
    ax.axhline(1.0, color="grey", lw=0.8, label="the limit (mpi4py's Allreduce)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    sizes = sorted(set(ALLREDUCE_MS[2]) | set(ALLREDUCE_MS[4]))
    names = [f"{s / 1e3:g} KB" if s < 1e5 else f"{s / 1e6:g} MB" for s in sizes]
    ax.set_xticks(sizes, names)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_yticks([1, 2, 3, 5, 10, 20, 50])
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
    ax.set(xlabel="payload, one float32 array", ylabel="time / the limit",
           title="A jitted allreduce against the MPI limit, one node")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--docs", type=Path, default=HERE.parent / "docs" / "benchmarks")
    args = parser.parse_args()
    plot_step_sync(args.docs / "step-sync.png")
    plot_allreduce(args.docs / "allreduce-one-node.png")


if __name__ == "__main__":
    main()
