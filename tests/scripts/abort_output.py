"""Output printed (not flushed) on one rank while another ends the job with MPI_Abort.

``python abort_output.py MODE``: every rank prints a line without flushing it (stdout is a
file: block-buffered), then rank 0 either reaches its normal end (``exit``) or waits in a
collective that the last rank never joins (``wait``), while the last rank, half a second
later, calls ``sys.exit(1)`` (``exit``) or raises (``wait``). Before jaxddp's abort the lines
stayed in the buffers of the ranks it killed.
"""

import sys
import time

import jaxddp

mode = sys.argv[1]
rank, size = jaxddp.rank(), jaxddp.world_size()
last = size - 1
jaxddp.allreduce({"ready": 1.0})  # every rank is up
print(f"rank {rank} printed this line and did not flush it")
if rank == last:
    time.sleep(0.5)
    if mode == "exit":
        sys.exit(1)
    raise RuntimeError("the last rank fails")
if mode == "wait":
    jaxddp.allreduce({"never": 1.0})  # the last rank never joins
