"""The digits example's training step with a Flax linen model (parameters as a plain pytree).

    mpiexec -n 2 python -m jaxddp.examples.digits_linen

Same data, sampler, options and checks as `jaxddp.examples.digits`; only the model and the
step differ: `model.apply` and `tx.update(grads, opt_state, params)` instead of
`nnx.Optimizer`, and the batch statistics (linen's `batch_stats`) travel beside the
parameters. `jaxddp.LinenSyncBatchNorm` computes them over the global batch, so they stay
identical on every rank and the model is one process's, at any world and batch size.
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
    """64 pixels -> 128 hidden units (batch-normalized) -> 10 classes."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mask: Any = None) -> jax.Array:
        hidden = nn.Dense(128, use_bias=False)(x)  # the norm would subtract a bias again
        # The statistics of every rank's real samples: the mask keeps the padding out.
        hidden = jaxddp.LinenSyncBatchNorm(use_running_average=not train, use_fast_variance=False)(
            hidden, mask=mask
        )
        return nn.Dense(10)(nn.relu(hidden))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, size = jaxddp.rank(), jaxddp.world_size()
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    model = MLP()
    variables = model.init(jax.random.key(args.seed + rank), jnp.zeros((1, 64)), train=False)
    # rank 0's initial parameters and statistics everywhere
    variables = jaxddp.synchronize(dict(variables))
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(args.lr))
    opt_state = tx.init(variables["params"])

    @jaxddp.spmd  # jax.jit; with JAXDDP_COLLECTIVES=xla, over the ranks' mesh (XLA's collectives)
    def train_step(variables: Any, opt_state: Any, x: Any, y: Any, mask: Any) -> Any:
        def loss_fn(p: Any) -> tuple[jax.Array, Any]:
            logits, updated = model.apply(
                {"params": p, "batch_stats": variables["batch_stats"]},
                x,
                train=True,
                mask=mask,
                mutable=["batch_stats"],
            )
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            # The exact mean over every rank's real samples: its gradient, averaged by
            # allreduce_gradients, is one process's gradient.
            return jaxddp.masked_mean(per_example, mask), updated["batch_stats"]

        params = variables["params"]
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # LinenSyncBatchNorm's statistics are the global batch's: the same on every rank.
        variables = {"params": params, "batch_stats": stats}
        return variables, opt_state, loss

    sampler = jaxddp.DistributedSampler(len(x_train), shuffle=True, seed=args.seed)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        losses = []
        for indices, mask in sampler.batches(args.batch_size):
            x, y = x_train[indices], y_train[indices]
            variables, opt_state, loss = train_step(variables, opt_state, x, y, mask)
            losses.append(float(loss))
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: mean loss {np.mean(losses):.4f}")

    test = jaxddp.DistributedSampler(len(x_test), shuffle=False)
    indices, mask = test.indices(), test.mask()
    logits = model.apply(variables, x_test[indices], train=False)
    assert isinstance(logits, jax.Array)  # apply returns (out, state) only with `mutable`
    hits = jnp.argmax(logits, -1) == y_test[indices]
    accuracy = float(jaxddp.masked_mean(hits, mask))
    same = identical_on_all_ranks(variables)  # parameters and batch statistics
    if rank == 0:
        print(f"test accuracy: {accuracy:.2%} ({len(x_test)} test images)")
        print(f"model identical on all {size} ranks: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
