"""Two ranks train; rank 1 raises at step 3 while rank 0 goes on into the next allreduce."""

import jax
import jax.numpy as jnp
import optax

import jaxddp

params = {"w": jnp.ones(4)}
tx = optax.chain(jaxddp.allreduce_gradients(), optax.sgd(0.1))
opt_state = tx.init(params)


@jax.jit
def step(params, opt_state):
    grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


for i in range(1000):
    if jaxddp.rank() == 1 and i == 3:
        raise RuntimeError("boom at step 3")
    params, opt_state = step(params, opt_state)
