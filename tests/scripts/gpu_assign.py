"""Prints, as one JSON line, which GPU ``import jaxddp`` gave this rank (against the stand-in
CUDA driver: JAXDDP_TEST_CUDA_DRIVER), and what it set for JAX.

``python gpu_assign.py SEEN...``: rank r sees the GPUs (PCI bus ids, separated by commas)
of ``SEEN[r % len(SEEN)]``; a ``;``-separated variable assignment after a ``|`` is set for
that rank only (``"0000:01:00.0|XLA_PYTHON_CLIENT_MEM_FRACTION=0.3"``).
"""

import json
import os
import sys

rank = int(os.environ.get("PMI_RANK", "0"))
seen, _, extra = sys.argv[1:][rank % len(sys.argv[1:])].partition("|")
os.environ["JAXDDP_TEST_GPUS"] = seen
for assignment in filter(None, extra.split(";")):
    name, _, value = assignment.partition("=")
    os.environ[name] = value

import jax

import jaxddp
from jaxddp._runtime import gpus

done = gpus.assignment()
print(
    json.dumps(
        {
            "rank": jaxddp.rank(),
            "ordinal": done.ordinal,
            "seen": list(done.seen),
            "sharing": list(done.sharing),
            "changes": list(done.changes),
            "visible": jax.config.values.get("jax_cuda_visible_devices"),
            "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
            "describe": done.describe(),
        }
    )
)
