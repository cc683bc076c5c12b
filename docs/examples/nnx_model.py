"""A Flax NNX model: `mpiexec -n 2 python docs/examples/nnx_model.py`."""

import jax
import numpy as np
import optax
from flax import nnx

import jaxddp

GLOBAL_BATCH, EPOCHS = 64, 3


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(5, 32, rngs=rngs)
        self.out = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


@nnx.jit
def train_step(model, optimizer, x, y, mask):
    def loss_fn(model):
        per_sample = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return jaxddp.masked_mean(per_sample, mask)  # the mean over every rank's samples

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # allreduce_gradients() runs first in the chain
    return loss


def main():
    rng = np.random.default_rng(0)  # the same data on every rank; 203 samples
    x = rng.normal(size=(203, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)

    model = MLP(nnx.Rngs(0))  # the same initial model on every rank (same seed)
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    sampler = jaxddp.DistributedSampler(len(x), seed=0)
    batch_size = GLOBAL_BATCH // jaxddp.world_size()  # per rank: one global batch of 64

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for indices, mask in sampler.batches(batch_size):
            loss = train_step(model, optimizer, x[indices], y[indices], mask)
        if jaxddp.rank() == 0:
            print(f"epoch {epoch}: loss {float(loss):.4f}")
    return nnx.state(model, nnx.Param)


if __name__ == "__main__":
    main()
