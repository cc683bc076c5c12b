"""Before ``MPI_Init``: a watcher process that ends a rank stuck there because another rank
died before starting MPI (``MPI_Init`` holds the GIL, so no Python thread can act).
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from collections.abc import Iterator

from ..._base import settings as _settings

# -- start-up -----------------------------------------------------------------------------

_STARTUP_WATCHER = r"""
import os, select, sys
fd, seconds, pid, rank = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ready, _, _ = select.select([fd], [], [], None if seconds == float("inf") else seconds)
if not ready:
    os.write(2, (
        f"jaxddp: rank {rank} waited {seconds:g} s in MPI_Init for the other ranks, and some "
        "never arrived: a rank probably died before initializing MPI (an error before or "
        "while importing jaxddp, such as a missing data file). Look for its traceback in the "
        "job's output. Killing this rank so that the job ends instead of hanging "
        "(JAXDDP_STALL_ABORT, or JAXDDP_STARTUP_TIMEOUT when that is unset, sets this "
        "limit).\n"
    ).encode())
    os.kill(pid, 9)
"""


def _expected_world() -> tuple[int | None, int | None]:
    """(world size, rank) as the launcher's environment says, before ``MPI_Init``."""
    from ..launcher.kinds import detect

    launch = detect(os.environ)
    if launch.name.startswith("none"):
        return 1, 0
    return launch.world_size, launch.rank


@contextlib.contextmanager
def startup_guard() -> Iterator[None]:
    """Around ``MPI_Init``: a watcher process kills this rank if it waits there too long.

    ``MPI_Init`` holds the GIL while it waits, so no Python thread could act; the watcher is
    a separate process that exits as soon as the pipe to this one closes (``MPI_Init``
    returned, or this process ended).
    """
    size, rank = _expected_world()
    seconds = _settings.startup_timeout()
    if size == 1 or math.isinf(seconds):
        yield
        return
    read, write = os.pipe()
    try:
        watcher = subprocess.Popen(
            [
                *(sys.executable, "-I", "-S", "-c", _STARTUP_WATCHER, str(read), repr(seconds)),
                *(str(os.getpid()), "?" if rank is None else str(rank)),
            ],
            pass_fds=(read,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
    except OSError:  # no process to spare: start MPI unguarded
        os.close(read)
        os.close(write)
        yield
        return
    os.close(read)
    try:
        yield
    finally:
        os.close(write)
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(timeout=5)
