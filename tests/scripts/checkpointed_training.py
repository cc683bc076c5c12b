"""Trains a small NNX model with jaxddp.CheckpointManager; the kill and resume tests' job.

    python checkpointed_training.py DIR OUT [--resume] [--kill-after-save K]
                                            [--kill-during-save K --ballast-mb M]
                                            [--kill-rank R] [--signal KILL|TERM]

Every 5 steps (a batch boundary, mid-epoch too) it saves parameters, optimizer state, the
sampler's state and the step, in the background (the manager's default). ``--kill-after-save
K``: once the K-th save of this run is complete on disk, rank 0 sends itself SIGKILL.
``--kill-during-save K``: a thread of rank R (0, the writer, by default) sends itself the
signal as soon as Orbax's temporary folder of the K-th save appears, while the loop trains on
(the state then carries M MB of ballast so that the save takes a while). At the end rank 0
writes the parameters to OUT (.npz). The global batch is 16 on any number of ranks.
"""

import argparse
import os
import signal
import threading
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxddp

N, GLOBAL_BATCH, EPOCHS, EVERY = 203, 16, 3, 5


class Net(nnx.Module):
    def __init__(self, rngs):
        self.inner = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.norm(self.inner(x))))


def kill_when_saving(directory, step, rank, how):
    """Sends this process ``how`` once Orbax's temporary folder for ``step`` exists."""
    prefix = f"{step}.orbax-checkpoint-tmp"

    def watch():
        while True:
            if os.path.isdir(directory) and any(
                n.startswith(prefix) for n in os.listdir(directory)
            ):
                print(f"killing rank {rank} with SIG{how} during save {step}", flush=True)
                os.kill(os.getpid(), getattr(signal, f"SIG{how}"))
                return
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-after-save", type=int, default=0)
    parser.add_argument("--kill-during-save", type=int, default=0)
    parser.add_argument("--ballast-mb", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--signal", choices=("KILL", "TERM"), default="KILL")
    args = parser.parse_args()
    rank, size = jaxddp.rank(), jaxddp.world_size()

    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, 5)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)).astype(np.int32)
    graph, params = nnx.split(Net(nnx.Rngs(0)))
    tx = optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-2))

    @jax.jit
    def step(params, opt_state, xb, yb, mask):
        def loss_fn(p):
            logits = nnx.merge(graph, p)(xb)
            per_sample = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
            return jaxddp.masked_mean(per_sample, mask)

        updates, opt_state = tx.update(jax.grad(loss_fn)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    sampler = jaxddp.DistributedSampler(N, shuffle=True, seed=11)
    ballast = np.zeros(args.ballast_mb << 18, np.float32)
    state = {"params": params, "opt": tx.init(params), "sampler": sampler.state_dict(),
             "step": 0, "ballast": ballast}  # fmt: skip
    ckpt = jaxddp.CheckpointManager(args.directory, max_to_keep=3)
    if args.resume:  # from the newest intact checkpoint
        state = ckpt.restore(None, target=state)
        sampler.load_state_dict(state["sampler"])
        print(f"resumed from step {state['step']} on {size} ranks", flush=True)
    if args.kill_during_save and rank == args.kill_rank:
        kill_when_saving(args.directory, args.kill_during_save, rank, args.signal)

    params, opt_state, done, saves = state["params"], state["opt"], state["step"], 0
    first = sampler.epoch
    for epoch in range(first, EPOCHS):
        if not (args.resume and epoch == first):  # a resumed epoch continues where it was
            sampler.set_epoch(epoch)
        for indices, mask in sampler.batches(GLOBAL_BATCH // size):
            params, opt_state = step(params, opt_state, x[indices], y[indices], mask)
            done += 1
            if done % EVERY == 0:
                state = {"params": params, "opt": opt_state, "sampler": sampler.state_dict(),
                         "step": done, "ballast": ballast}  # fmt: skip
                ckpt.save(done, state)
                saves += 1
                if saves == args.kill_after_save:
                    ckpt.wait_until_finished()
                if rank == 0 and saves == args.kill_after_save:
                    print(f"killing rank 0 after save {done}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    if rank == 0:
        flat = {jax.tree_util.keystr(p): np.asarray(v)
                for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}  # fmt: skip
        np.savez(args.out, steps=done, **flat)
    print(f"done: {done} steps", flush=True)


if __name__ == "__main__":
    main()
