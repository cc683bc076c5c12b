"""Compiles and runs one step holding many jaxddp collectives, for test_ordering.py.

Run with TF_CPP_VMODULE=thunk_executor=6 so that XLA:CPU logs each executable's thunk
execution graph: which thunk waits for which. The step holds large leaves that travel alone,
float32 and bfloat16 buckets, an integer leaf, a reduction inside a ``lax.cond`` (the only
conditional in the step), a broadcast and a max; ``flat`` holds the same without the
``lax.cond``; ``outer`` calls ``helper``, a jitted function first called on its own, between
two collectives of its own (jaxddp replays ``helper`` into it); ``sharded`` is a
``shard_optimizer`` update (an alltoall and an allgather per dtype, float32 and bfloat16, and
the allreduce of the global norm between them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxddp

rng = np.random.default_rng(jaxddp.rank())
tree = {
    **{
        f"big{i}": jnp.asarray(rng.standard_normal(300_000 + i, dtype=np.float32)) for i in range(3)
    },
    **{
        f"small{i}": jnp.asarray(rng.standard_normal((i + 1, 7), dtype=np.float32))
        for i in range(20)
    },
    "half": jnp.ones(33, jnp.bfloat16),
    "count": jnp.int32(jaxddp.rank()),
}


@jax.jit
def step(tree, k):
    mean = jaxddp.allreduce(tree)
    inner = jax.lax.cond(
        k > 0,
        lambda: jaxddp.allreduce({"x": tree["small3"] * 2}, op="sum"),
        lambda: {"x": tree["small3"]},
    )
    root = jaxddp.broadcast(tree["big0"] * 3)
    top = jaxddp.allreduce(tree["small0"].sum(), op="max")
    return mean, inner, root, top


@jax.jit
def flat(tree):
    """No control flow: every collective is at the jit's own level (the fast path)."""
    mean = jaxddp.allreduce(tree)
    root = jaxddp.broadcast(tree["small3"] * 3)
    top = jaxddp.allreduce(tree["small0"].sum(), op="max")
    return mean, root, top


@jax.jit
def helper(x, y):
    return jaxddp.allreduce(x, op="sum"), jaxddp.allreduce(y, op="max")


@jax.jit
def outer(tree):
    low = jaxddp.allreduce(tree["small0"] * 5, op="min")
    total, top = helper(tree["big1"], tree["small1"])
    return low, total, top, jaxddp.allreduce(tree["big2"], op="max")


params = {"w": tree["small5"], "half": tree["half"]}
tx = jaxddp.shard_optimizer(optax.adam(1e-3), clip_global_norm=1.0)
sharded = jax.jit(tx.update)

jax.block_until_ready(sharded(params, tx.init(params), params))
jax.block_until_ready(helper(tree["big1"], tree["small1"]))
jax.block_until_ready(outer(tree))
jax.block_until_ready(flat(tree))
jax.block_until_ready(step(tree, 1))
print("step done", flush=True)
