"""An Equinox model: `mpiexec -n 2 python docs/examples/equinox_model.py`."""

import equinox as eqx
import jax
import numpy as np
import optax

import jaxddp

GLOBAL_BATCH, EPOCHS = 64, 3


def make_train_step(tx):
    @eqx.filter_jit
    def train_step(model, opt_state, x, y, mask):
        def loss_fn(model):
            logits = jax.vmap(model)(x)
            per_sample = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jaxddp.masked_mean(per_sample, mask)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        # the parameters are the model's arrays, eqx.filter(model, eqx.is_array): passing
        # the model itself (functions and all) fails
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return train_step


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(203, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)

    model = eqx.nn.MLP(5, 3, width_size=32, depth=1, key=jax.random.key(0))
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    train_step = make_train_step(tx)
    sampler = jaxddp.DistributedSampler(len(x), seed=0)
    batch_size = GLOBAL_BATCH // jaxddp.world_size()

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for indices, mask in sampler.batches(batch_size):
            model, opt_state, loss = train_step(model, opt_state, x[indices], y[indices], mask)
        if jaxddp.rank() == 0:
            print(f"epoch {epoch}: loss {float(loss):.4f}")
    return eqx.filter(model, eqx.is_array)


if __name__ == "__main__":
    main()
