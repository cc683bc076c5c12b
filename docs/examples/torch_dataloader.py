"""PyTorch's DataLoader: `mpiexec -n 2 python docs/examples/torch_dataloader.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch.utils.data

import jaxddp
import jaxddp.torch

GLOBAL_BATCH, EPOCHS = 64, 3


class Samples(torch.utils.data.Dataset):
    """A map-style data set, as for any PyTorch DataLoader."""

    def __init__(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(203, 5)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (5, 32)) * 0.3, "b1": jnp.zeros(32),
            "w2": jax.random.normal(k2, (32, 3)) * 0.3}  # fmt: skip


def make_train_step(tx):
    @jax.jit
    def train_step(params, opt_state, x, y, mask):
        def loss_fn(p):
            logits = jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]
            per_sample = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jaxddp.masked_mean(per_sample, mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def main():
    dataset = Samples()
    sampler = jaxddp.DistributedSampler(len(dataset), seed=0)
    loader = jaxddp.torch.DataLoader(
        dataset,
        sampler,
        GLOBAL_BATCH // jaxddp.world_size(),
        num_workers=1,
        multiprocessing_context="spawn",  # JAX is multithreaded: fork is unsafe
        persistent_workers=True,  # the workers start once, not every epoch
    )

    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))
    params = init_params(jax.random.key(0))
    opt_state = tx.init(params)
    train_step = make_train_step(tx)
    for epoch in range(sampler.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for (x, y), mask in loader:  # mask: a bool tensor, False at padding
            params, opt_state, loss = train_step(
                params, opt_state, x.numpy(), y.numpy(), mask.numpy()
            )
            # loader.state_dict() counts the batches taken here, not those the workers
            # read ahead: save it to resume mid-epoch (loader.load_state_dict)
        if jaxddp.rank() == 0:
            print(f"epoch {epoch}: loss {float(loss):.4f}")
    return params


if __name__ == "__main__":  # needed: the spawned workers import this file
    main()
