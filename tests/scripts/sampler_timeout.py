"""Rank 0 builds its sampler; rank 1 never does. Rank 0 must raise within the deadline."""

import time

import jaxddp

if jaxddp.rank() == 0:
    start = time.monotonic()
    try:
        jaxddp.DistributedSampler(10)
    except TimeoutError as exc:
        print(f"rank 0 raised after {time.monotonic() - start:.1f} s: {exc}", flush=True)
        raise
else:
    print("rank 1 never builds its sampler", flush=True)
    time.sleep(30)
