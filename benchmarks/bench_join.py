"""What `jaxddp.join` adds to a training loop, against the same loop over the sampler.

    mpiexec -n 2 python benchmarks/bench_join.py --out benchmarks/results/join-np2.json

The step is a plain `jax.jit` + optax step (no NNX) of the step benchmark's smallest residual
MLP (4 blocks of width 256: 20 parameter leaves, 1.1 MB of gradients), with
`optax.chain(jaxddp.allreduce_gradients(), optax.adam)` and `jaxddp.masked_mean` for the
loss. Two loops over the same batches, steps back to back as training runs them (one
`block_until_ready` at the end of a pass):

- ``sampler``: ``for indices, mask in sampler.batches(B): step(..., X[indices], ...)``;
- ``join``: the same batches read by a per-rank generator, through ``jaxddp.join``: what
  join adds is its first-step agreement, the one byte per rank per step, the checks.

The loops take turns, one pass of each per round; per-step times are a pass's time over its
steps, and the figure is the median over the rounds of ``join - sampler`` in each round, in
wall-clock time and in this process's CPU time (less moved by other work on the machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxddp

D_IN, D_OUT = 32, 10


def init(blocks: int, width: int) -> dict:
    keys = iter(jax.random.split(jax.random.key(0), blocks + 2))

    def linear(a: int, b: int) -> dict:
        return {"w": jax.random.normal(next(keys), (a, b)) * a**-0.5, "b": jnp.zeros(b)}

    return {
        "inp": linear(D_IN, width),
        "blocks": [
            {"linear": linear(width, width), "scale": jnp.ones(width), "bias": jnp.zeros(width)}
            for _ in range(blocks)
        ],
        "out": linear(width, D_OUT),
    }


def forward(params: dict, x: jax.Array) -> jax.Array:
    h = x @ params["inp"]["w"] + params["inp"]["b"]
    for block in params["blocks"]:
        z = jax.nn.relu(h @ block["linear"]["w"] + block["linear"]["b"])
        z = (z - z.mean(-1, keepdims=True)) * jax.lax.rsqrt(z.var(-1, keepdims=True) + 1e-6)
        h = h + z * block["scale"] + block["bias"]
    return h @ params["out"]["w"] + params["out"]["b"]


def make_step(tx: optax.GradientTransformation):
    @jax.jit
    def step(params, opt_state, x, y, mask):
        def loss_fn(p):
            losses = optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y)
            return jaxddp.masked_mean(losses, mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--steps", type=int, default=50, help="steps per pass")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rank, size = jaxddp.rank(), jaxddp.world_size()
    B, K = args.batch_size, args.steps
    n = size * B * K
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, D_IN)).astype(np.float32)
    Y = rng.integers(0, D_OUT, size=n).astype(np.int32)
    sampler = jaxddp.DistributedSampler(n, seed=0)

    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))
    step = make_step(tx)
    params = init(args.blocks, args.width)
    state = [params, tx.init(params)]

    cpu: dict[str, list[float]] = {"sampler": [], "join": []}

    def run(batches, name: str) -> float:
        start, used = time.perf_counter(), time.process_time()
        loss = None
        for x, y, mask in batches:
            state[0], state[1], loss = step(state[0], state[1], x, y, mask)
        jax.block_until_ready(loss)
        cpu[name].append((time.process_time() - used) / K)
        return (time.perf_counter() - start) / K

    def sampler_loop() -> float:
        return run(((X[i], Y[i], m) for i, m in sampler.batches(B)), "sampler")

    def join_loop() -> float:
        stream = ({"x": X[i], "y": Y[i]} for i, _ in sampler.batches(B))
        return run(((b["x"], b["y"], m) for b, m in jaxddp.join(stream)), "join")

    loops = {"sampler": sampler_loop, "join": join_loop}
    for loop in loops.values():  # compile, warm up
        loop()
    for times in cpu.values():
        times.clear()
    samples: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            samples[name].append(loops[name]())
    medians = {name: statistics.median(s) for name, s in samples.items()}
    paired = statistics.median(
        j - s for j, s in zip(samples["join"], samples["sampler"], strict=True)
    )
    # CPU seconds of this process (all its threads) per step: what join makes a rank do,
    # less moved by other processes on the machine than the wall clock
    cpu_paired = statistics.median(j - s for j, s in zip(cpu["join"], cpu["sampler"], strict=True))
    leaves = len(jax.tree.leaves(params))
    row = {
        "ranks": size,
        "param_leaves": leaves,
        "batch_per_rank": B,
        "steps_per_pass": K,
        "rounds": args.rounds,
        "jax": jax.__version__,
        "sampler_step_s": medians["sampler"],
        "join_step_s": medians["join"],
        "join_adds_s": paired,
        "join_adds_share": paired / medians["sampler"],
        "sampler_cpu_s": statistics.median(cpu["sampler"]),
        "join_adds_cpu_s": cpu_paired,
    }
    if rank == 0:
        print(
            f"{size} ranks, {leaves} leaves: step over the sampler "
            f"{medians['sampler'] * 1e3:.3f} ms, over join {medians['join'] * 1e3:.3f} ms; "
            f"join adds {paired * 1e6:.1f} us a step ({100 * paired / medians['sampler']:.2f}%), "
            f"{cpu_paired * 1e6:.1f} CPU-us",
            flush=True,
        )
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
