"""The digits example's training step with a Flax linen model (parameters as a plain pytree).

    mpiexec -n 2 python -m jaxddp.examples.digits_linen

Same data, sampler, options and checks as `jaxddp.examples.digits`; only the model and the
step differ: `model.apply` and `tx.update(grads, opt_state, params)` instead of
`nnx.Optimizer`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxddp
from jaxddp.examples.digits import identical_on_all_ranks, load_digits, parse_args


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))


def predict(model: MLP, params: Any, x: Any) -> jax.Array:
    logits = model.apply({"params": params}, x)
    assert isinstance(logits, jax.Array)  # apply returns (out, state) only with `mutable`
    return logits


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, size = jaxddp.rank(), jaxddp.world_size()
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    model = MLP()
    params = model.init(jax.random.key(args.seed + rank), jnp.zeros((1, 64)))["params"]
    params = jaxddp.synchronize(params)  # rank 0's initial parameters everywhere
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(args.lr))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params: Any, opt_state: Any, x: Any, y: Any, mask: Any) -> Any:
        def loss_fn(p: Any) -> tuple[jax.Array, jax.Array]:
            logits = predict(model, p, x)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jnp.sum(per_example * mask) / jnp.maximum(jnp.sum(mask), 1), per_example

        (_, per_example), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        loss = jaxddp.masked_mean(per_example, mask)
        return optax.apply_updates(params, updates), opt_state, loss

    sampler = jaxddp.DistributedSampler(len(x_train), shuffle=True, seed=args.seed)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        losses = []
        for indices, mask in sampler.batches(args.batch_size):
            x, y = x_train[indices], y_train[indices]
            params, opt_state, loss = train_step(params, opt_state, x, y, mask)
            losses.append(float(loss))
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: mean loss {np.mean(losses):.4f}")

    test = jaxddp.DistributedSampler(len(x_test), shuffle=False)
    indices, mask = test.indices(), test.mask()
    hits = jnp.argmax(predict(model, params, x_test[indices]), -1) == y_test[indices]
    accuracy = float(jaxddp.masked_mean(hits, mask))
    same = identical_on_all_ranks(params)
    if rank == 0:
        print(f"test accuracy: {accuracy:.2%} ({len(x_test)} test images)")
        print(f"parameters identical on all {size} ranks: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
