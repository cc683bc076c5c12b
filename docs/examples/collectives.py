"""broadcast, reduce and shard_optimizer: `mpiexec -n 2 python docs/examples/collectives.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxddp

GLOBAL_BATCH, EPOCHS = 64, 3


def loss_fn(params, x, y, mask):
    logits = x @ params["w"] + params["b"]
    per_sample = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jaxddp.masked_mean(per_sample, mask)  # the mean over every rank's samples


def main():
    rank, world = jaxddp.rank(), jaxddp.world_size()
    rng = np.random.default_rng(0)  # the same data on every rank; 203 samples
    x = rng.normal(size=(203, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)

    # broadcast: rank 0's values reach every rank. Here only rank 0's key is the one wanted
    # (it could as well have read the parameters from a file only rank 0 can see).
    key = jax.random.key(42 if rank == 0 else rank)
    params = {"w": 0.1 * jax.random.normal(key, (5, 3)), "b": jnp.zeros(3)}
    params = jaxddp.broadcast(params, root=0)  # now rank 0's on every rank

    # shard_optimizer: adam whose moments are split across the ranks (1/W each), in place of
    # optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2)); the step is unchanged.
    tx = jaxddp.shard_optimizer(optax.adam(1e-2))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, mask)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    sampler = jaxddp.DistributedSampler(len(x), seed=0)
    mine = np.arange(rank, len(x), world)  # this rank's share of the evaluation
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for indices, mask in sampler.batches(GLOBAL_BATCH // world):
            params, opt_state, loss = train_step(params, opt_state, x[indices], y[indices], mask)

        # reduce: every rank's counts summed onto rank 0 alone, which prints them; the other
        # ranks get their own values back, unchanged
        predicted = np.asarray(jnp.argmax(x[mine] @ params["w"] + params["b"], axis=-1))
        counts = {"correct": int((predicted == y[mine]).sum()), "seen": len(mine)}
        totals = jaxddp.reduce(counts, "sum", root=0)
        if rank == 0:
            accuracy = totals["correct"] / totals["seen"]
            print(f"collectives: epoch {epoch}: loss {float(loss):.4f}, accuracy {accuracy:.3f}")
    return params


if __name__ == "__main__":
    main()
