"""The process's stdout and stderr in a job that may be aborted: what a rank printed must
reach the job's output before ``MPI_Abort`` kills it.

Three things lose it, each with its remedy here:

- Python's buffer. Under a launcher stdout is a pipe, so Python buffers it in blocks, and
  a rank killed by an abort takes the block with it. :func:`line_buffered` (called once MPI
  reports more than one rank) writes every line when it is printed, so even a rank that can
  no longer run Python (its main thread holding the GIL in C code, the stall inspector off)
  has lost nothing it printed whole; :func:`flush` writes what is left of a line.
- The launcher's pipe. MPICH's hydra drops what is still unread in a rank's pipe when the
  abort reaches it (the last line before ``MPI_Abort`` in 9 of 300 jobs, the tail of 100 KB
  printed before it in 9 of 20). :func:`wait_until_read` waits until the launcher has read
  this process's pipes, before a rank tells the aborting one it has flushed and before the
  aborting one calls ``MPI_Abort``.
- The other ranks' buffers: the stall inspector asks each rank to do both
  (:func:`jaxddp._runtime.watchdog.abort_job`).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import io
import os
import stat
import sys
import termios
import time

__all__ = ["flush", "line_buffered", "wait_until_read"]

POLL = 0.001  # seconds between two looks at what the launcher has not read yet


def line_buffered() -> None:
    """Makes the process's stdout and stderr write each line as it is printed (a few
    microseconds a line). ``sys.stdout.reconfigure(line_buffering=False)`` afterwards gives
    the block buffer back, and with it the risk of losing lines in an abort."""
    for stream in {id(s): s for s in (sys.__stdout__, sys.__stderr__)}.values():
        if isinstance(stream, io.TextIOWrapper) and not stream.line_buffering:
            with contextlib.suppress(Exception):  # a closed or detached stream
                stream.reconfigure(line_buffering=True)


def flush() -> None:
    """Flushes this process's stdout and stderr, never raising (a closed stream, a pipe
    whose reader is gone)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def _unread(fd: int) -> int:
    """The bytes written to the pipe ``fd`` that its reader has not read yet (0 when the
    pipe cannot tell)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:
        return 0
    return count[0]


def wait_until_read(seconds: float) -> bool:
    """Waits at most ``seconds`` until the reader of this process's stdout and stderr (the
    launcher, when they are pipes) has read all that was written to them; True when it has.
    Streams that are not pipes (a file, a terminal) have nothing to wait for."""
    pipes = []
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                pipes.append(fd)
    deadline = time.monotonic() + seconds
    while True:
        pipes = [fd for fd in pipes if _unread(fd) > 0]
        if not pipes:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)
