"""The README's headline table: what gradient sync adds to a plain train step, jaxddp against
PyTorch DDP and JAX's own multi-process program, in one launch.

    JAXDDP_COLLECTIVES=xla mpiexec -bind-to core -n 2 python benchmarks/bench_headline.py \\
        --out benchmarks/results/headline-np2.json

(``JAXDDP_COLLECTIVES=xla`` starts JAX's distributed runtime, which JAX's own program needs;
jaxddp's step below is a plain ``jax.jit`` step and keeps jaxddp's MPI collectives.)

The models: the residual MLPs of the step benchmark, 4 blocks of width 256 (20 leaves),
24 of width 64 (100 leaves), 100 of width 32 (404 leaves); a batch of 32 samples of 64
features per rank; Adam. Timed, taking turns (``interleaved``: one sample of each per
round, each sample ``--steps`` steps back to back, medians over ``--repeats`` rounds):

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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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

MODELS = ((4, 256), (24, 64), (100, 32))  # (blocks, width): 20, 100, 404 leaves
FEATURES, CLASSES = 64, 10


def jax_steps(params: Any, batch: Any, tx: Any, steps: int) -> Callable[[], None]:
    """``steps`` jitted steps of ``tx`` back to back, the state fed back."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(residual_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = [params, tx.init(params)]

    def run() -> None:
        for _ in range(steps):
            state[0], state[1], loss = step(state[0], state[1], batch)
        jax.block_until_ready(loss)

    return run


def own_steps(params: Any, batch: Any, steps: int) -> Callable[[], None]:
    adam = optax.adam(1e-3)

    def step(params, opt_state, batch):  # the loss: the global batch's mean
        loss, grads = jax.value_and_grad(residual_loss)(params, batch)
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    once = own_program(step, params, adam.init(params), _stacked(batch))

    def run() -> None:
        for _ in range(steps):
            once()

    return run


def torch_steps(blocks: int, width: int, batch: Any, steps: int, ddp: bool) -> Callable[[], None]:
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

    def run() -> None:
        for _ in range(steps):
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


def measure(blocks: int, width: int, steps: int, repeats: int, torch: bool) -> dict[str, Any]:
    key = jax.random.PRNGKey(jaxddp.rank())
    x = np.asarray(jax.random.normal(key, (32, FEATURES)))
    y = np.asarray(jax.random.randint(key, (32,), 0, CLASSES))
    params = residual_params(jax.random.PRNGKey(0), width=width, blocks=blocks)
    fns: dict[str, Callable[[], object]] = {
        "jax_alone": jax_steps(params, (x, y), optax.adam(1e-3), steps),
        "jaxddp": jax_steps(
            params, (x, y), optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3)), steps
        ),
        "jax_own": own_steps(params, (x, y), steps),
    }
    if torch:
        fns["torch_alone"] = torch_steps(blocks, width, (x, y), steps, ddp=False)
        fns["torch_ddp"] = torch_steps(blocks, width, (x, y), steps, ddp=True)
    medians = interleaved(fns, 3, repeats)
    step = {name: s / steps for name, s in medians.items()}
    adds = {
        "jaxddp": step["jaxddp"] - step["jax_alone"],
        "jax_own": step["jax_own"] - step["jax_alone"],
    }
    if torch:
        adds["torch_ddp"] = step["torch_ddp"] - step["torch_alone"]
    leaves = len(jax.tree.leaves(params))
    nbytes = sum(np.asarray(v).nbytes for v in jax.tree.leaves(params))
    return {"blocks": blocks, "width": width, "leaves": leaves, "bytes": nbytes,
            "step_s": step, "sync_adds_s": adds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps back to back per sample")
    parser.add_argument("--repeats", type=int, default=41, help="rounds")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch_version = start_torch()
    rows = [measure(b, w, args.steps, args.repeats, torch_version is not None) for b, w in MODELS]
    if jaxddp.rank() != 0:
        return
    versions = {"jax": jax.__version__, "torch": torch_version, "ranks": jaxddp.world_size()}
    columns = [("jaxddp", f"jaxddp (jax {jax.__version__})")]
    if torch_version:
        columns.append(("torch_ddp", f"PyTorch {torch_version.split('+')[0]} DDP (gloo)"))
    columns.append(("jax_own", f"JAX's own multi-process `jax.jit` (jax {jax.__version__}, gloo)"))
    header = " | ".join(f"{r['leaves']} leaves, {r['bytes'] / 1e6:.2g} MB" for r in rows)
    print(f"| gradient sync by | {header} |")
    print("|---" * (len(rows) + 1) + "|")
    for key, label in columns:
        print(
            f"| {label} | "
            + " | ".join(f"{r['sync_adds_s'][key] * 1e3:.3g} ms" for r in rows)
            + " |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**versions, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
