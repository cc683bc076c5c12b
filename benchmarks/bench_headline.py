"""The README's headline table: what gradient sync adds to a plain train step, jaxddp against
PyTorch DDP and JAX's own multi-process program, in one launch.

    JAXDDP_COLLECTIVES=xla mpiexec -bind-to core -n 2 python benchmarks/bench_headline.py \\
        --out benchmarks/results/headline-np2.json

(``JAXDDP_COLLECTIVES=xla`` starts JAX's distributed runtime, which JAX's own program needs;
jaxddp's step below is a plain ``jax.jit`` step and keeps jaxddp's MPI collectives.)

The models: the residual MLPs of the step benchmark, 4 blocks of width 256 (20 leaves),
24 of width 64 (100 leaves), 100 of width 32 (404 leaves); a batch of 32 samples of 64
features per rank; Adam. Timed, taking turns (``interleaved``: one sample of each per
round, each sample some steps back to back, medians over ``--repeats`` rounds):

* ``jax_alone``: the step under ``jax.jit`` with ``optax.adam`` alone (no sync);
* ``jaxddp``: the same with ``optax.chain(jaxddp.allreduce_gradients(), optax.adam)``;
* ``jax_own``: JAX's own data parallelism (one ``jax.jit`` over the ranks' mesh, replicated
  parameters fed back, the batch made global each step; XLA all-reduces the gradient over
  gloo on a CPU);
* ``torch_alone`` and ``torch_ddp``: the same model in PyTorch (``nn.Linear``,
  ``nn.LayerNorm``; one intra-op thread, as each JAX rank has one XLA thread), stepped
  alone and wrapped in ``DistributedDataParallel`` over gloo (skipped where torch is not
  installed).

"Sync adds" is the step with sync minus the step alone of the same framework (JAX's own
against ``jax_alone``). Printed as a Markdown table, with the versions measured.

Each variant takes its own number of steps per sample: as many as fill ``--sample-ms`` (at
most ``--steps``, at least one), chosen on rank 0 from a warm step and shared, so JAX's own
program at 100 and 404 leaves (steps of 0.4 and 1.5 s over gloo here) takes one step per
sample while the others take ten, and the run ends in minutes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# one XLA thread per rank (each rank has its core): set before JAX starts
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
import optax

import jaxddp
from benchmarks.bench_allreduce import interleaved, start_torch_gloo
from benchmarks.bench_xla import _stacked, own_program, residual_loss, residual_params
from benchmarks.headline_table import table
from benchmarks.steps import optax_step
from jaxddp._collectives import api as _comm

MODELS = ((4, 256), (24, 64), (100, 32))  # (blocks, width): 20, 100, 404 leaves
FEATURES, CLASSES = 64, 10


Steps = Callable[[int], None]  # runs n train steps back to back, then waits for the last


def jax_steps(params: Any, batch: Any, tx: Any) -> Steps:
    """Jitted steps of ``tx`` back to back, the state fed back."""
    step = jax.jit(optax_step(tx, residual_loss))
    state = [params, tx.init(params)]

    def run(n: int) -> None:
        for _ in range(n):
            state[0], state[1], loss = step(state[0], state[1], batch)
        jax.block_until_ready(loss)

    return run


def own_steps(params: Any, batch: Any) -> Steps:
    adam = optax.adam(1e-3)
    step = optax_step(adam, residual_loss)  # over the global batch: its mean
    once = own_program(step, params, adam.init(params), _stacked(batch))

    def run(n: int) -> None:
        for _ in range(n):
            once()

    return run


def torch_steps(blocks: int, width: int, batch: Any, ddp: bool) -> Steps:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + torch.relu(self.linear(self.norm(h)))

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(
        nn.Linear(FEATURES, width), *(Block() for _ in range(blocks)), nn.Linear(width, CLASSES)
    )
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = (torch.from_numpy(np.array(a)) for a in batch)  # writable copies
    y = y.long()

    def run(n: int) -> None:
        for _ in range(n):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    return run


def start_torch() -> str | None:
    """torch's version with its gloo process group started, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    start_torch_gloo()
    return torch.__version__


def steps_per_sample(runs: dict[str, Steps], most: int, sample_s: float) -> dict[str, int]:
    """How many steps each variant takes per sample: enough to fill ``sample_s`` from a warm
    step's time on rank 0 (clamped to 1..``most``), the same on every rank (each sample's
    collectives must match)."""
    counts = {}
    for name, run in runs.items():
        run(1)  # compiles
        start = time.perf_counter()
        run(1)
        counts[name] = max(1, min(most, round(sample_s / (time.perf_counter() - start))))
    return _comm.py_comm().bcast(counts, root=0)


def measure(
    blocks: int, width: int, *, most: int, sample_s: float, repeats: int, torch: bool
) -> dict[str, Any]:
    key = jax.random.PRNGKey(jaxddp.rank())
    x = np.asarray(jax.random.normal(key, (32, FEATURES)))
    y = np.asarray(jax.random.randint(key, (32,), 0, CLASSES))
    params = residual_params(jax.random.PRNGKey(0), width=width, blocks=blocks)
    runs: dict[str, Steps] = {
        "jax_alone": jax_steps(params, (x, y), optax.adam(1e-3)),
        "jaxddp": jax_steps(
            params, (x, y), optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))
        ),
        "jax_own": own_steps(params, (x, y)),
    }
    if torch:
        runs["torch_alone"] = torch_steps(blocks, width, (x, y), ddp=False)
        runs["torch_ddp"] = torch_steps(blocks, width, (x, y), ddp=True)
    counts = steps_per_sample(runs, most, sample_s)
    medians = interleaved(
        {name: functools.partial(run, counts[name]) for name, run in runs.items()}, 2, repeats
    )
    step = {name: s / counts[name] for name, s in medians.items()}
    adds = {
        "jaxddp": step["jaxddp"] - step["jax_alone"],
        "jax_own": step["jax_own"] - step["jax_alone"],
    }
    if torch:
        adds["torch_ddp"] = step["torch_ddp"] - step["torch_alone"]
    leaves = len(jax.tree.leaves(params))
    nbytes = sum(np.asarray(v).nbytes for v in jax.tree.leaves(params))
    return {"blocks": blocks, "width": width, "leaves": leaves, "bytes": nbytes,
            "steps_per_sample": counts, "step_s": step, "sync_adds_s": adds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=10, help="the most steps back to back per sample"
    )
    parser.add_argument(
        "--sample-ms", type=float, default=500.0, help="a sample's length the steps fill"
    )
    parser.add_argument("--repeats", type=int, default=21, help="rounds")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--table", type=Path, help="print the table of an earlier run's --out and stop"
    )
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    torch_version = start_torch()
    rows = [
        measure(
            b,
            w,
            most=args.steps,
            sample_s=args.sample_ms / 1e3,
            repeats=args.repeats,
            torch=torch_version is not None,
        )
        for b, w in MODELS
    ]
    if jaxddp.rank() != 0:
        return
    result = {"jax": jax.__version__, "torch": torch_version, "ranks": jaxddp.world_size()}
    result["rows"] = rows
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
