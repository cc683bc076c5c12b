"""Dispatches a step holding large collectives and exits without waiting for it.

The executable is still inside MPI when the interpreter exits: jaxddp must let it finish
before MPI is finalized, or the job crashes or hangs in ``MPI_Finalize``.
"""

import jax
import jax.numpy as jnp

import jaxddp

tree = [jnp.full(4_000_000, float(jaxddp.rank() + i)) for i in range(4)]
step = jax.jit(lambda t: jaxddp.allreduce(t, op="sum"))
jax.block_until_ready(step(tree))  # compiled and run once
for _ in range(3):
    out = step(tree)  # dispatched, not waited for
print("dispatched", flush=True)
