"""Two ranks train a step wrapped in ``jaxddp.spmd``; each is sent SIGTERM, as a scheduler's
stop sends it (the SIGTERM tests' job, on both paths).

Rank 0 installs its own SIGTERM handler before ``import jaxddp`` (a program that checkpoints
when it is told to stop: the handler records the signal, the loop acts on it) and sends
itself SIGTERM at step 3; the handler must run. Rank 1 keeps the default disposition and
sends itself SIGTERM at step 6: it must end, and the launcher then ends the job. A rank that
trains through its signal prints that it ran all steps.
"""

import os
import signal
import time

caught: list[int] = []
if os.environ.get("PMI_RANK") == "0":  # MPICH's hydra names the rank; jaxddp is not yet up
    signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))

import jax.numpy as jnp

import jaxddp

rank = jaxddp.rank()


@jaxddp.spmd
def step(x):
    return jaxddp.allreduce(x * 2.0, op="mean")


x = jnp.ones(3)
for i in range(100):
    if (rank, i) in ((0, 3), (1, 6)):
        print(f"rank {rank} sends itself SIGTERM at step {i}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    x = step(x)
    if caught:
        print(f"rank {rank}'s own handler caught SIGTERM at step {i}", flush=True)
        caught.clear()
    time.sleep(0.05)
print(f"rank {rank} ran all steps", flush=True)
