"""A Flax linen model with a TrainState: `mpiexec -n 2 python docs/examples/linen_train_state.py`."""

import flax.linen as nn
import jax
import numpy as np
import optax
from flax.training import train_state

import jaxddp

GLOBAL_BATCH, EPOCHS = 64, 3


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jax.nn.relu(nn.Dense(32)(x)))


@jax.jit
def train_step(state, x, y, mask):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        per_sample = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jaxddp.masked_mean(per_sample, mask)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss  # tx averages the gradients first


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(203, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)

    model = MLP()
    params = model.init(jax.random.key(0), x[:1])["params"]  # the same key on every rank
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    sampler = jaxddp.DistributedSampler(len(x), seed=0)
    batch_size = GLOBAL_BATCH // jaxddp.world_size()

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for indices, mask in sampler.batches(batch_size):
            state, loss = train_step(state, x[indices], y[indices], mask)
        if jaxddp.rank() == 0:
            print(f"epoch {epoch}: loss {float(loss):.4f}")
    return state.params


if __name__ == "__main__":
    main()
