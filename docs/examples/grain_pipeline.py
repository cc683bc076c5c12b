"""A grain pipeline: `mpiexec -n 2 python docs/examples/grain_pipeline.py`."""

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxddp
import jaxddp.grain

GLOBAL_BATCH, EPOCHS = 64, 3
WORKERS = 0  # grain's worker processes per rank (mp_prefetch); 0 reads in this process


class Samples:
    """A grain data source: len() and random access (an ArrayRecord file, a list...)."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(203, 5)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int32) + (self.x[:, 1] > 0.5)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def standardize(sample):  # a per-sample transformation, run by grain (in its workers)
    return {"x": (sample["x"] - 0.1) / 1.1, "y": sample["y"]}


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
    source = Samples()
    dataset = grain.MapDataset.source(source).map(standardize)  # every sample, unsharded
    sampler = jaxddp.DistributedSampler(len(source), seed=0)
    options = grain.MultiprocessingOptions(num_workers=WORKERS) if WORKERS else None
    loader = jaxddp.grain.batches(
        dataset, sampler, GLOBAL_BATCH // jaxddp.world_size(), multiprocessing_options=options
    )

    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))
    params = init_params(jax.random.key(0))
    opt_state = tx.init(params)
    train_step = make_train_step(tx)
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        iterator = iter(loader)  # one pass: this rank's batches of the epoch
        for batch, mask in iterator:
            params, opt_state, loss = train_step(params, opt_state, batch["x"], batch["y"], mask)
            # iterator.get_state() == sampler.state_dict(): save it with the parameters to
            # resume here, on any number of ranks (iterator.set_state or load_state_dict)
        if jaxddp.rank() == 0:
            print(f"epoch {epoch}: loss {float(loss):.4f}")
    return params


if __name__ == "__main__":  # needed: grain's workers import this file
    main()
