"""A small data-parallel loop that stalls in the way MODE says, for the stall inspector tests.

``python stall.py MODE [SECONDS]``: the last rank misbehaves at batch 3 (``sleep``: sleeps
forever in its data loading; ``break_exit``: leaves the loop and calls ``sys.exit(0)``;
``exit1``: calls ``sys.exit(1)``; ``sigkill``/``sigstop``: sends itself that signal; ``tree``:
its gradient tree has one more leaf, with ``check=False``; ``slow``: sleeps 2 s per batch but
keeps going), or runs 12 s of jitted steps and nothing else from Python (``steps``, healthy),
or rank 0 alone calls a collective after the loop (``rank0_only``). SECONDS, for ``slow`` and
``steps``, replaces their 2 s and 12 s. ``healthy SLOW STEPS``: the three healthy runs in one
job, each with its own lines: ``caught_exit.py`` (a caught ``SystemExit``, then a
collective), then ``slow`` with SLOW s per batch, then ``steps`` for STEPS s. ``gil0``: rank 0 blocks at batch 3 in a C call
that holds the GIL (libc's ``sleep`` through ``ctypes.pythonapi``), where none of its
Python threads can run. With ``tree``, each step's loss is also reduced from
Python, so the extra leaf's collective deadlocks against it. Lines the tests look for carry a
``# LINE:`` marker.
"""

import ctypes
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import jaxddp

mode = sys.argv[1]
if mode == "healthy":  # first, as that script runs alone: right after `import jaxddp`
    runpy.run_path(str(Path(__file__).with_name("caught_exit.py")), run_name="__main__")
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else {"slow": 2.0, "steps": 12.0}.get(mode, 0.0)
slow = mode in ("slow", "healthy")
rank, size = jaxddp.rank(), jaxddp.world_size()
last = size - 1
data = np.arange(64 * 4, dtype=np.float32).reshape(64, 4) / 256

params = {"w": jnp.ones(4)}
reduce_grads = jaxddp.allreduce_gradients(check=False)
tx = optax.sgd(0.01)
opt_state = tx.init(params)
# With `tree`, the last rank's gradient tree has one more leaf (a counter that found its way
# into it), which travels in a collective of its own that the other ranks never call.
extra_leaf = mode == "tree" and rank == last


@jax.jit
def step(params, opt_state, x, mask):
    def loss_fn(p):
        return jnp.sum(jnp.where(mask, (x @ p["w"]) ** 2, 0.0)) / x.shape[0]

    loss, grads = jax.value_and_grad(loss_fn)(params)
    if extra_leaf:
        grads = {**grads, "zcount": jnp.ones((), jnp.int32)}
    grads, _ = reduce_grads.update(grads, reduce_grads.init(grads))
    updates, opt_state = tx.update({"w": grads["w"]}, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# With JAXDDP_COLLECTIVES=xla (tests/test_stall.py's xla case) the step runs over the ranks'
# mesh and its collectives are XLA's; otherwise this is the jitted step itself.
step = jaxddp.spmd(step)


def misbehaves():
    print(f"rank {rank} misbehaves at {time.time():.3f}", file=sys.stderr, flush=True)


def load_batch(indices, k):
    if mode == "sleep" and rank == last and k == 3:
        misbehaves()
        time.sleep(3600)  # LINE: sleep
    if slow and rank == last:
        time.sleep(seconds)
    return data[indices]


def run_steps(seconds, params, opt_state):
    """Healthy: ``seconds`` of jitted steps whose collectives are all compiled."""
    burn = jax.jit(lambda y: jax.lax.fori_loop(0, 400, lambda i, y: jnp.tanh(y @ y), y))
    x, mask = jnp.asarray(data[:16]), jnp.ones(16, bool)
    y = jnp.eye(256) / 2
    start, steps = time.time(), 0
    while jaxddp.allreduce({"go": time.time() - start < seconds}, op="min")["go"]:
        for _ in range(20):  # no jaxddp call from Python for seconds at a time
            params, opt_state, _ = step(params, opt_state, x, mask)
            burn(y).block_until_ready()
            steps += 1
    print(f"rank {rank} finished {steps} steps", flush=True)


def wait_for_a_moving_write(seconds):
    """Rank 0 waits ``seconds`` for a checkpoint write that keeps writing (as a
    CheckpointManager waits for its save in flight: a real thread appending to a real file,
    slower than any write Orbax makes of a test's state); the others wait in a broadcast."""
    from jaxddp._training.checkpoint import background

    if rank == 0:
        folder = tempfile.mkdtemp(prefix="jaxddp-stall-write-")

        def write():
            end = time.monotonic() + seconds
            os.mkdir(os.path.join(folder, "1.orbax-checkpoint-tmp-0"))  # as Orbax names it
            with open(os.path.join(folder, "1.orbax-checkpoint-tmp-0", "part"), "ab") as f:
                while time.monotonic() < end:
                    f.write(b"x" * 4096)
                    f.flush()
                    time.sleep(0.05)

        start = time.monotonic()
        assert background.Write(1, write, folder, lambda e: "other").wait() is None
        print(f"waited {time.monotonic() - start:.1f} s for a moving write", flush=True)
        shutil.rmtree(folder)
    MPI.COMM_WORLD.bcast(None)


if mode == "steps":
    run_steps(seconds, params, opt_state)
    sys.exit(0)

sampler = jaxddp.DistributedSampler(len(data), shuffle=False)
batches = 8 if slow else 1000
for epoch in range(batches):
    sampler.set_epoch(epoch)
    for k, (indices, mask) in enumerate(sampler.batches(4)):
        if k == 2 and epoch == 0:  # kept by the abort (tests/test_stall.py runs it buffered)
            print(f"rank {rank} printed this at batch 2 and did not flush it")
        if k == 3 and rank == 0 and mode == "gil0":
            misbehaves()
            ctypes.pythonapi.sleep(3600)  # LINE: gil0
        if k == 3 and rank == last and mode in ("break_exit", "exit1", "sigkill", "sigstop"):
            misbehaves()
            if mode == "break_exit":
                break
            if mode == "exit1":
                sys.exit(1)  # LINE: exit1
            if mode in ("sigkill", "sigstop"):
                os.kill(os.getpid(), signal.SIGKILL if mode == "sigkill" else signal.SIGSTOP)
        if mode == "tree" and rank == last and k == 0:
            misbehaves()
        x = load_batch(indices, k)  # LINE: load
        params, opt_state, loss = step(params, opt_state, x, mask)  # LINE: step
        loss = float(loss)  # LINE: loss
        if mode == "tree":  # metrics, reduced from Python each step
            loss = float(jaxddp.allreduce({"loss": loss})["loss"])  # LINE: metrics
    if mode == "break_exit" and rank == last:
        print(f"rank {rank} left the loop", flush=True)
        sys.exit(0)  # LINE: exit0
    if (mode == "rank0_only" or slow) and epoch == 0:
        break

if mode == "rank0_only" and rank == 0:
    misbehaves()
    total = jaxddp.allreduce({"loss": loss}, op="sum")  # LINE: rank0_only
print(f"rank {rank} finished", flush=True)
if mode == "healthy":
    run_steps(float(sys.argv[3]), params, opt_state)
    wait_for_a_moving_write(5.0)
