"""Conditional computation: a toy mixture of experts whose expert depends on the rank.

    mpiexec -n 2 python -m jaxddp.examples.moe

Rank r sends its data through expert ``r % n_experts`` only, and differentiates only the
parameters it used: its gradient tree lacks every other expert, so the ranks' trees differ.
A plain allreduce of those trees would pair up the wrong arrays or wait forever.
``jaxddp.allreduce_gradients()`` fills the missing experts with zeros against the full
parameter tree before it communicates, so every rank sends the same tree and applies the same
update: nothing deadlocks, and nothing has to be called by hand. Experts that no rank used stay
exactly as they were.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxddp

DESCRIPTION = "A toy mixture of experts whose expert depends on the rank, trained on every rank."
FEATURES = 8


def init_params(key: jax.Array, n_experts: int, hidden: int = 16) -> dict[str, Any]:
    keys = jax.random.split(key, n_experts + 1)
    experts = {
        f"expert{i}": {
            "w": jax.random.normal(k, (FEATURES, hidden)) / jnp.sqrt(FEATURES),
            "b": jnp.zeros(hidden),
        }
        for i, k in enumerate(keys[:-1])
    }
    head = {"w": jax.random.normal(keys[-1], (hidden, 1)) / jnp.sqrt(hidden), "b": jnp.zeros(1)}
    return {"experts": experts, "head": head}


def make_step(expert: str, tx: optax.GradientTransformation) -> Any:
    """A jitted step that runs (and differentiates) only `expert`; `expert` differs by rank."""

    def loss_fn(used: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
        e = used["experts"][expert]
        hidden = jax.nn.relu(x @ e["w"] + e["b"])
        prediction = (hidden @ used["head"]["w"] + used["head"]["b"])[:, 0]
        return jnp.mean((prediction - y) ** 2)

    @jax.jit
    def step(
        params: dict[str, Any], opt_state: Any, x: jax.Array, y: jax.Array
    ) -> tuple[Any, Any, jax.Array]:
        # Only what this rank used: the other experts are simply absent from `grads`.
        used = {"experts": {expert: params["experts"][expert]}, "head": params["head"]}
        loss, grads = jax.value_and_grad(loss_fn)(used, x, y)
        # allreduce_gradients resolves `grads` against `params` (zeros for the missing
        # experts), then averages every leaf over the ranks.
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jaxddp.allreduce(loss)

    return step


def identical_on_all_ranks(tree: Any) -> bool:
    """Whether every rank holds bitwise the same values: the max over ranks equals the min."""
    flat = jnp.concatenate([jnp.ravel(leaf) for leaf in jax.tree.leaves(tree)])
    return bool(jnp.all(jaxddp.allreduce(flat, op="max") == jaxddp.allreduce(flat, op="min")))


def unchanged(a: Any, b: Any) -> bool:
    leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(bool(jnp.all(x == y)) for x, y in leaves)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rank, size = jaxddp.rank(), jaxddp.world_size()

    def say(*args: Any, **kwargs: Any) -> None:
        if rank == 0:
            print(*args, **kwargs)

    expert = f"expert{rank % args.experts}"
    used_by_some_rank = {f"expert{r % args.experts}" for r in range(size)}

    params = jaxddp.synchronize(init_params(jax.random.key(args.seed), args.experts))
    initial = params
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(args.lr))
    opt_state = tx.init(params)
    step = make_step(expert, tx)

    # Each rank's own data: a shared linear target, seen through different samples.
    key = jax.random.fold_in(jax.random.key(args.seed + 1), rank)
    x = jax.random.normal(key, (64, FEATURES))
    y = x @ jnp.linspace(-1.0, 1.0, FEATURES)

    say(f"{size} ranks, {args.experts} experts; rank r runs expert{{r % {args.experts}}} only")
    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        if i % 5 == 0 or i == args.steps - 1:
            say(f"step {i + 1:3d}: loss {float(loss):.4f} (mean over ranks)")

    same = identical_on_all_ranks(params)
    unused = sorted(set(params["experts"]) - used_by_some_rank)
    untouched = all(unchanged(params["experts"][n], initial["experts"][n]) for n in unused)
    say(f"parameters identical on all {size} ranks: {'yes' if same else 'NO'}")
    say(f"experts used by no rank ({', '.join(unused) or 'none'}) unchanged: ", end="")
    say("yes" if untouched else "NO")
    return 0 if same and untouched else 1


if __name__ == "__main__":
    raise SystemExit(main())
