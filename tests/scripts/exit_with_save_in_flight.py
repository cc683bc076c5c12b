"""Leaves the program with a background save still in flight, without closing the manager.

    python exit_with_save_in_flight.py DIR ok|fail

``ok``: saves step 1 (32 MB) and ends at once: the save is waited for at exit. ``fail``:
saves step 1, makes DIR unwritable on rank 0 (``chattr +i``), saves step 2 and ends: every
rank prints why step 2 was not saved and the job ends with status 1.
"""

import subprocess
import sys

import jax.numpy as jnp

import jaxddp

directory, mode = sys.argv[1], sys.argv[2]
ckpt = jaxddp.CheckpointManager(directory)
ckpt.save(1, {"w": jnp.full((8 << 20,), 1.0, jnp.float32)})
if mode == "fail":
    ckpt.wait_until_finished()
    if jaxddp.rank() == 0:
        subprocess.run(["chattr", "+i", directory], check=True)
    ckpt.save(2, {"w": jnp.zeros(3)})
print(f"rank {jaxddp.rank()} leaves with save {2 if mode == 'fail' else 1} in flight", flush=True)
