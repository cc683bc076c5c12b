"""The last rank fails reading its data before ``import jaxddp``: the others wait in MPI_Init."""

import os
import time

rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
if rank == size - 1:
    print(f"rank {rank} misbehaves at {time.time():.3f}", flush=True)
    with open("/nonexistent/jaxddp-test-data.npz", "rb") as f:  # FileNotFoundError
        f.read()

import jaxddp

print(f"rank {jaxddp.rank()} started", flush=True)
