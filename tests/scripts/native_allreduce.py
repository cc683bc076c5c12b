"""Run on ranks: which allreduce handler the ranks agreed on, and its values.

``split``, ``split-shared``, ``split-check``, ``split-collectives``: the launcher's rank 1
turns jaxddp's handler, the shared-memory allreduce or the signature check off (or the XLA
collectives on) before importing jaxddp, so the ranks
disagree on a setting that changes what a collective sends: every rank must raise the same
SettingError when jaxddp's world starts, before any collective (printed as ``error``).
Prints one JSON line per rank.
"""

import json
import os
import sys

from tests.harness.rank import launcher_rank

if sys.argv[1] == "split" and launcher_rank() == "1":
    os.environ["JAXDDP_NATIVE_ALLREDUCE"] = "0"
if sys.argv[1] == "split-shared" and launcher_rank() == "1":
    os.environ["JAXDDP_SHARED_ALLREDUCE"] = "0"
if sys.argv[1] == "split-check" and launcher_rank() == "1":
    os.environ["JAXDDP_CHECK"] = "off"
if sys.argv[1] == "split-collectives" and launcher_rank() == "1":
    os.environ["JAXDDP_COLLECTIVES"] = "xla"  # its world starts (and disagrees) at import

import jax
import jax.numpy as jnp
import numpy as np

try:
    import jaxddp
except ValueError as error:  # a SettingError (a ValueError) raised while the world starts
    print(json.dumps({"error": str(error)}), flush=True)
    sys.exit(0)
from jaxddp import _native
from jaxddp._base.settings import SettingError

try:
    rank, size = jaxddp.rank(), jaxddp.world_size()
except SettingError as error:
    print(json.dumps({"error": str(error)}), flush=True)
    sys.exit(0)
x = jnp.arange(1000, dtype=jnp.float32) + rank
f = jax.jit(lambda x: jaxddp.allreduce(x, op="sum"))
hlo = f.lower(x).compile().as_text()
got = np.asarray(f(x))
want = sum(np.arange(1000, dtype=np.float32) + r for r in range(size))
print(
    json.dumps(
        {
            "target": _native.allreduce_target(),
            "status": _native.status(),
            "in_hlo": _native.TARGET in hlo,
            "mpi4jax_in_hlo": "mpi_allreduce_ffi" in hlo,
            "values_ok": bool(np.array_equal(got, want)),
            "shared_calls": _native.shared_calls(),
        }
    ),
    flush=True,
)
