"""Rank 0 checks its gradient tree; rank 1 runs other code (an allreduce) and never arrives."""

import jax.numpy as jnp

import jaxddp

if jaxddp.rank() == 0:
    tx = jaxddp.allreduce_gradients(check=True)
    tx.update({"w": jnp.ones(3)}, tx.init(None))
else:
    jaxddp.allreduce({"other": jnp.ones(5)})
