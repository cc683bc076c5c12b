"""Output printed (not flushed) on every rank while one of them ends the job with MPI_Abort.

``python abort_output.py MODE``: every rank prints :data:`LINES` lines without flushing them
(stdout is a pipe: Python buffers it), then all ranks meet, so that every rank has printed
before anything fails. Then the last rank prints :data:`LINES` more, more than a pipe holds,
and at once calls ``sys.exit(1)`` (``exit``: rank 0 reaches its normal end) or raises
(``wait``: rank 0 waits in a collective that the last rank never joins). Every line of every
rank must reach the job's output: before jaxddp's abort they stayed in the buffers of the
ranks it killed, and the launcher dropped what it had not yet read of a rank's pipe.
"""

import sys

import jaxddp

LINES = 1000  # 45 KB a burst, near the 64 KB a pipe holds

mode = sys.argv[1]
rank, size = jaxddp.rank(), jaxddp.world_size()
last = size - 1


def burst(what: str) -> None:
    for i in range(LINES):
        print(f"rank {rank} {what} line {i:04d} of {LINES}, not flushed")


jaxddp.allreduce({"ready": 1.0})
burst("before")
jaxddp.allreduce({"printed": 1.0})  # every rank has printed its lines
if rank == last:
    burst("last")
    if mode == "exit":
        sys.exit(1)
    raise RuntimeError("the last rank fails")
if mode == "wait":
    jaxddp.allreduce({"never": 1.0})  # the last rank never joins
