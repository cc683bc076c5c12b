"""A 2-rank training loop over N = 7 samples with one allreduce per batch.

``naive``: rank r takes ``range(r*4, min((r+1)*4, 7))``, so rank 1 has 3 batches and rank 0
has 4: rank 1 leaves the loop and rank 0 waits forever in its fourth allreduce (Flux.jl:
https://github.com/FluxML/Flux.jl/pull/2694). ``sampler``: the same loop over
``DistributedSampler.batches``, which finishes.

Usage: ``python naive_shards.py naive|sampler``.
"""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxddp

N = 7
BATCH_SIZE = 1

rank, size = jaxddp.rank(), jaxddp.world_size()
data = jnp.arange(N, dtype=jnp.float32) + 1


@jax.jit
def train_on_batch(indices, mask):
    """A stand-in for a training step: the gradient allreduce is the collective that hangs."""
    values = data[indices]
    return jaxddp.allreduce(
        {"sum": jnp.sum(jnp.where(mask, values, 0.0)), "count": jnp.sum(mask)}, op="sum"
    )


def run_step(indices, mask):
    """A Python frame around the compiled step, so that a dumped stack names where it hangs."""
    return train_on_batch(indices, mask)


def naive_batches():
    s = math.ceil(N / size)
    shard = np.arange(rank * s, min((rank + 1) * s, N))
    for begin in range(0, len(shard), BATCH_SIZE):
        indices = shard[begin : begin + BATCH_SIZE]
        yield indices, np.ones(len(indices), bool)


def sampler_batches():
    return jaxddp.DistributedSampler(N, seed=0).batches(BATCH_SIZE)


mode = sys.argv[1]
batches = {"naive": naive_batches, "sampler": sampler_batches}[mode]()
total, count, steps = 0.0, 0, 0
for indices, mask in batches:
    out = run_step(indices, mask)
    total += float(out["sum"])
    count += int(out["count"])
    steps += 1
print(f"rank {rank} finished after {steps} batches: count {count}, sum {total}", flush=True)
if mode == "sampler" and (count != N or total != N * (N + 1) / 2):
    sys.exit(f"rank {rank}: expected count {N} and sum {N * (N + 1) / 2}")
