"""Output printed (not flushed) on every rank while one of them ends the job with MPI_Abort.

``python abort_output.py MODE``: every rank prints :data:`LINES` lines without flushing them
(stdout is a pipe: Python buffers it), then all ranks meet, so that every rank has printed
before anything fails. Then the last rank prints :data:`LINES` more, more than a pipe holds,
and at once calls ``sys.exit(1)`` (``exit``: rank 0 reaches its normal end) or raises
(``wait``: rank 0 waits in a collective that the last rank never joins). Every line of every
rank must reach the job's output: before jaxddp's abort they stayed in the buffers of the
ranks it killed, and the launcher dropped what it had not yet read of a rank's pipe.

``python abort_output.py steady FOLDER``: every rank but the last prints a line of 1 KB every
0.1 ms and, once ``print`` returned, writes its number to ``FOLDER/truth-<rank>``; the last
rank raises half a second after they start. Every line whose number is in a truth file must
be in the job's output, whole: the printing ranks used to go on printing after they had
flushed, and lost the lines of the last milliseconds before the abort killed them; with
``PYTHONUNBUFFERED`` a line's text and its newline were two writes, and another rank's line
came between them.
"""

import os
import sys
import time

import jaxddp

LINES = 1000  # 45 KB a burst, near the 64 KB a pipe holds

mode = sys.argv[1]
rank, size = jaxddp.rank(), jaxddp.world_size()
last = size - 1


def burst(what: str) -> None:
    for i in range(LINES):
        print(f"rank {rank} {what} line {i:04d} of {LINES}, not flushed")


jaxddp.allreduce({"ready": 1.0})
if mode == "steady":
    if rank == last:
        time.sleep(0.5)
        raise RuntimeError("the last rank fails while the others print")
    truth = os.open(os.path.join(sys.argv[2], f"truth-{rank}"), os.O_WRONLY | os.O_CREAT)
    i = 0
    while True:
        print(f"rank {rank} steady line {i:07d} " + "x" * 1000)
        os.write(truth, b"%d\n" % i)
        i += 1
        pause = time.perf_counter() + 0.0001
        while time.perf_counter() < pause:
            pass
burst("before")
jaxddp.allreduce({"printed": 1.0})  # every rank has printed its lines
if rank == last:
    burst("last")
    if mode == "exit":
        sys.exit(1)
    raise RuntimeError("the last rank fails")
if mode == "wait":
    jaxddp.allreduce({"never": 1.0})  # the last rank never joins
