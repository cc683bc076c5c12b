"""End-to-end train step of the example model, with and without gradient sync.

    mpiexec -n 2 python benchmarks/bench_step.py --out benchmarks/results/step-np2.json

The same jitted step (forward, backward, adam) runs twice: with
``optax.chain(jaxddp.allreduce_gradients(), optax.adam)`` and with plain ``optax.adam``.
The difference is what communication costs a step; its share of the step is reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import optax

import jaxddp
from benchmarks.bench_allreduce import timed


def mlp_params(key: jax.Array, sizes: tuple[int, ...]) -> dict[str, dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return {
        f"layer{i}": {
            "w": jax.random.normal(k, (a, b)) * (2 / a) ** 0.5,
            "b": jnp.zeros(b),
        }
        for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))
    }


def loss_fn(params, x, y):
    h = x
    for i in range(len(params)):
        layer = params[f"layer{i}"]
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def make_step(tx):
    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--sizes", default="64,128,10", help="the digits example's MLP")
    parser.add_argument("--repeats", type=int, default=51)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    params = mlp_params(jax.random.key(0), sizes)
    x = jax.random.normal(jax.random.key(1 + jaxddp.rank()), (args.batch_size, sizes[0]))
    y = jax.random.randint(jax.random.key(2), (args.batch_size,), 0, sizes[-1])
    result = {"ranks": jaxddp.world_size(), "batch_per_rank": args.batch_size, "sizes": sizes}
    for name, tx in (
        ("with_sync", optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))),
        ("without_sync", optax.adam(1e-3)),
    ):
        step = make_step(tx)
        state = [params, tx.init(params)]

        def run(step=step, state=state):
            p, s, loss = step(state[0], state[1], x, y)
            state[0], state[1] = p, s
            jax.block_until_ready(loss)

        result[f"{name}_s"] = timed(run, 5, args.repeats)
    result["communication_share"] = 1 - result["without_sync_s"] / result["with_sync_s"]
    if jaxddp.rank() == 0:
        print(
            f"step with sync {result['with_sync_s'] * 1e3:.3f} ms, without "
            f"{result['without_sync_s'] * 1e3:.3f} ms: communication is "
            f"{result['communication_share']:.0%} of the step"
        )
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
