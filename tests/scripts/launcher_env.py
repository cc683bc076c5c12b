"""Prints this rank's launcher-related environment as one JSON line (standard library only).

Used to record launcher captures (``tests/data/launcher_env_*.json``) and by the real-launch
tests to see what a launcher really sets. Nothing here touches MPI.
"""

import json
import os
import sys

PREFIXES = (
    "PMI_",
    "PMIX_",
    "OMPI_",
    "PRTE_",
    "OPAL_",
    "HYD",
    "MPI_LOCAL",
    "I_MPI_",
    "HYDRA_",
    "SLURM_",
    "MV2_",
    "PALS_",
)


def main() -> None:
    found = {k: v for k, v in sorted(os.environ.items()) if k.startswith(PREFIXES)}
    json.dump(found, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
