"""The same benchmarks against two source trees of jaxddp, alternating, in one sitting.

    python benchmarks/compare_trees.py --before ../old-checkout --after . --rounds 3 \\
        --out benchmarks/results/before-after.json

Each round launches, for each tree in turn (the order flips every round), that tree's own
``bench_nnx_step.py`` (the three residual MLPs as Flax NNX steps), ``bench_step.py`` (plain
``jax.jit`` + optax steps) and ``bench_eager.py`` (the eager metrics allreduce), each rank
bound to a core as ``run.py`` launches them. Each tree is imported from its own folder (the
scripts put their tree first on ``sys.path``), with the Python running this script. Printed
and written: per case, the median over rounds of each tree's figure and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
SCRIPTS = {  # name: (script, arguments, the figures compared per case)
    "nnx-step": ("bench_nnx_step.py", ["--repeats", "21"], ("alone_s", "with_sync_s", "sync_s")),
    "step": ("bench_step.py", ["--repeats", "31"], ("without_sync_s", "with_sync_s", "sync_s")),
    "eager": ("bench_eager.py", ["--repeats", "201"], None),
}


def launch(tree: Path, script: str, args: list[str], ranks: int, out: Path) -> dict:
    command = [MPIEXEC, "-bind-to", "core", "-n", str(ranks), sys.executable,
               str(tree / "benchmarks" / script), *args, "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True, timeout=900, cwd=tree)
    return json.loads(out.read_text())


def figures(name: str, result: dict) -> dict[str, float]:
    """The comparable figures of one run, by "case: figure"."""
    if name == "eager":
        return {f"{k}": v for k, v in result["medians_s"].items()}
    keep = SCRIPTS[name][2] or ()
    out = {}
    for case in result["cases"]:
        label = case["model"] + (f" ({case['layout']})" if "layout" in case else "")
        out.update({f"{label}: {k}": case[k] for k in keep})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--only", default=",".join(SCRIPTS))
    parser.add_argument("--nnx-models", help="bench_nnx_step.py's --models (all by default)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, dict[str, dict[str, list[float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in args.only.split(","):
                script, extra, _ = SCRIPTS[name]
                if name == "nnx-step" and args.nnx_models:
                    extra = [*extra, "--models", args.nnx_models]
                for which in order:
                    out = Path(tmp) / f"{name}-{which}-{r}.json"
                    result = launch(trees[which], script, extra, args.ranks, out)
                    for key, value in figures(name, result).items():
                        runs.setdefault(name, {}).setdefault(key, {}).setdefault(which, []).append(
                            value
                        )
    table = {}
    for name, cases in runs.items():
        for key, by_tree in cases.items():
            before = statistics.median(by_tree["before"])
            after = statistics.median(by_tree["after"])
            table[f"{name} | {key}"] = {"before_s": before, "after_s": after, "runs": by_tree}
            ratio = f"{after / before:.3f}" if before > 0 else "-"
            print(f"{name:>9} | {key:<60} before {before * 1e3:9.3f} ms  after "
                  f"{after * 1e3:9.3f} ms  after/before {ratio}")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"before": str(trees["before"]), "after": str(trees["after"]),
                "rounds": args.rounds, "ranks": args.ranks}  # fmt: skip
        args.out.write_text(json.dumps({**meta, "figures": table}, indent=1))


if __name__ == "__main__":
    main()
