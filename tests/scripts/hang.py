"""Rank 0 enters an allreduce that rank 1 never joins: the deadlock the watchdog must catch."""

import time

import jax.numpy as jnp

import jaxddp


def wait_for_the_others():
    return jaxddp.allreduce({"x": jnp.ones(3)}, op="sum")


def never_joins():
    time.sleep(3600)


print(f"rank {jaxddp.rank()} starts its hang", flush=True)
if jaxddp.rank() == 0:
    wait_for_the_others()
else:
    never_joins()
