"""Rank 0 traces a step that checks its gradient tree; rank 1 runs other code (an allreduce
outside jit) and never arrives at that check."""

import jax
import jax.numpy as jnp

import jaxddp

if jaxddp.rank() == 0:
    tx = jaxddp.allreduce_gradients(check=True)
    jax.jit(tx.update)({"w": jnp.ones(3)}, tx.init(None))
else:
    jaxddp.allreduce({"other": jnp.ones(5)})
