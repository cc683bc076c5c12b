"""Per-rank streams of uneven length: `mpiexec -n 2 python docs/examples/uneven_streams.py`."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxddp

BATCH, EPOCHS = 16, 4  # rows per rank and step; passes over every rank's stream
TRUE_W = np.array([1.0, -2.0, 0.5, 3.0], np.float32)


def records(shard, num_shards):
    """This rank's own records: in a real job, its own files or its grain/torch shard."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 4)).astype(np.float32)
    y = x @ TRUE_W + 0.1 * rng.normal(size=400).astype(np.float32)
    for i in range(shard, len(x), num_shards):
        yield x[i], y[i]


def batches(shard, num_shards):
    """A filter that keeps a different share on each rank, then batches of BATCH rows (the
    last one short): the ranks' streams end after different numbers of batches."""
    kept = ((x, y) for x, y in records(shard, num_shards) if abs(y) < 2.0 + 2 * shard)
    while chunk := list(itertools.islice(kept, BATCH)):
        xs, ys = zip(*chunk, strict=True)
        yield {"x": np.stack(xs), "y": np.array(ys)}


def make_step(tx, mean):
    @jax.jit
    def step(params, opt_state, batch, mask):
        def loss_fn(p):
            residual = batch["x"] @ p["w"] + p["b"] - batch["y"]
            return mean(residual**2, mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def init():
    return {"w": jnp.zeros(4), "b": jnp.zeros(())}


def main():
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(0.05))
    step = make_step(tx, jaxddp.masked_mean)  # the mean over every rank's real rows
    params = init()
    opt_state = tx.init(params)
    for epoch in range(EPOCHS):
        stream = batches(jaxddp.rank(), jaxddp.world_size())  # this rank's, its own length
        for batch, mask in jaxddp.join(stream):  # the same number of steps on every rank
            params, opt_state, loss = step(params, opt_state, batch, mask)
        if jaxddp.rank() == 0:
            print(f"epoch {epoch}: loss {float(loss):.4f}")
    return params


def one_process(num_ranks):
    """What one process trains when step k takes the real rows of every rank's k-th batch
    together: the model `main` trains on `num_ranks` ranks, exactly."""
    tx = optax.adam(0.05)
    step = make_step(tx, lambda values, mask: jnp.mean(values))
    params = init()
    opt_state = tx.init(params)
    streams = [list(batches(r, num_ranks)) for r in range(num_ranks)]
    for _ in range(EPOCHS):
        for k in range(max(map(len, streams))):
            parts = [s[k] for s in streams if k < len(s)]
            batch = {key: np.concatenate([p[key] for p in parts]) for key in ("x", "y")}
            params, opt_state, _ = step(params, opt_state, batch, None)
    return params


if __name__ == "__main__":
    main()
