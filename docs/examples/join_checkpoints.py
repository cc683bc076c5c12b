"""Checkpoints of a training on per-rank streams (`jaxddp.join`), resumed mid-epoch:
`mpiexec -n 2 python docs/examples/join_checkpoints.py ckpt`; run the same command again
after a preemption to resume from the newest checkpoint in `ckpt`."""

import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxddp

BATCH, EPOCHS, EVERY = 16, 3, 8  # rows per rank and step; passes; steps between saves
TRUE_W = np.array([1.0, -2.0, 0.5, 3.0], np.float32)


def batches(shard, num_shards, epoch):
    """This rank's own stream for one epoch (in a real job: its own files, shuffled per
    epoch, filtered), of a length of its own: the ranks' streams end at different steps. A
    stream without a state of its own must yield the same batches again when reopened."""
    rng = np.random.default_rng(shard)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    y = x @ TRUE_W + 0.1 * rng.normal(size=200).astype(np.float32)
    order = np.random.default_rng(epoch).permutation(len(x))
    kept = (i for i in order if abs(y[i]) < 2.0 + 2 * shard)  # more rows on higher ranks
    while chunk := list(itertools.islice(kept, BATCH)):
        yield {"x": x[chunk], "y": y[chunk]}


def stream_target(world_size):
    """The restore target of a join's `state_dict()`, for a stream without a state of its
    own: the keys `state_dict()` returns, one entry per rank (a grain iterator's entries
    also hold `"stream": iterator.get_state()`). Only its structure and dtypes count, so no
    join is opened to make it."""
    return {
        "version": 1,
        "world_size": world_size,
        "steps": 0,
        "batch_size": 0,
        "ranks": [{"taken": 0, "ended": False} for _ in range(world_size)],
    }


def optimizer():
    return optax.chain(jaxddp.allreduce_gradients(), optax.adam(0.05))


def main(directory, stop_after=None):
    """Trains EPOCHS passes over every rank's stream, saving every EVERY steps; resumes
    from the newest checkpoint in `directory` if there is one. `stop_after` (a step count)
    ends the run there on every rank, as a preemption would."""
    tx = optimizer()

    @jax.jit
    def step(params, opt_state, batch, mask):
        def loss_fn(p):
            residual = batch["x"] @ p["w"] + p["b"] - batch["y"]
            return jaxddp.masked_mean(residual**2, mask)  # every rank's real rows

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"w": jnp.zeros(4), "b": jnp.zeros(())}
    opt_state = tx.init(params)
    state = {"params": params, "opt_state": opt_state, "epoch": 0}
    rank, world = jaxddp.rank(), jaxddp.world_size()
    with jaxddp.CheckpointManager(directory, max_to_keep=2) as checkpoints:
        done = checkpoints.latest_step() or 0  # steps done; the same on every rank
        resumed = None
        if done:
            target = {**state, "stream": stream_target(world)}
            resumed = checkpoints.restore(done, target)  # another world size: ValueError
            state = {k: resumed[k] for k in state}
        for epoch in range(state["epoch"], EPOCHS):
            joined = jaxddp.join(batches(rank, world, epoch), batch_size=BATCH)
            if resumed is not None:  # the epoch that was saved: continue its streams
                joined.load_state_dict(resumed.pop("stream"))
                resumed = None
            for batch, mask in joined:  # the same number of steps on every rank
                params, opt_state, _ = step(state["params"], state["opt_state"], batch, mask)
                state = {"params": params, "opt_state": opt_state, "epoch": epoch}
                done += 1
                if done % EVERY == 0:  # state_dict() on every rank: a collective
                    checkpoints.save(done, {**state, "stream": joined.state_dict()})
                if done == stop_after:
                    return state["params"]
    return state["params"]


if __name__ == "__main__":
    final = main(sys.argv[1])
    if jaxddp.rank() == 0:
        print("w:", np.round(np.asarray(final["w"]), 3), "b:", float(final["b"]))
