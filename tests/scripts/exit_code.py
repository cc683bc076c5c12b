"""Rank 1 exits with the code given on the command line; the others exit 0."""

import sys

import jaxddp

if jaxddp.rank() == 1:
    print("rank 1 leaving early", flush=True)
    sys.exit(int(sys.argv[1]))
