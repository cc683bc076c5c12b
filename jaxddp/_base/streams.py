"""The process's stdout and stderr in a job that may be aborted: what a rank printed must
reach the job's output before ``MPI_Abort`` kills it, each line in one piece.

Four things lose it or break it, each with its remedy here:

- Python's buffer. Under a launcher stdout is a pipe, so Python buffers it in blocks, and
  a rank killed by an abort takes the block with it. :func:`line_buffered` (called once MPI
  reports more than one rank) writes every line when it is printed, so even a rank that can
  no longer run Python (its main thread holding the GIL in C code, the stall inspector off)
  has lost nothing it printed whole; :func:`flush` writes what is left of a line.
- Lines written in two pieces. With ``PYTHONUNBUFFERED`` (or ``python -u``) Python writes
  through to the file descriptor at every ``write``, and ``print`` writes a line's text and
  its newline with two: the launcher, which merges the ranks' pipes, then puts another
  rank's line between them (two ranks' lines on one line of the job's output, 3 aborts in
  10). :func:`line_buffered` turns writing through off, so that a line leaves in one write.
- The launcher's pipe. MPICH's hydra drops what is still unread in a rank's pipe when the
  abort reaches it (the last line before ``MPI_Abort`` in 9 of 300 jobs, the tail of 100 KB
  printed before it in 9 of 20). :func:`wait_until_read` waits until the launcher has read
  this process's pipes, before a rank tells the aborting one it has flushed and before the
  aborting one calls ``MPI_Abort``.
- A rank that goes on printing. The rank told to flush keeps running until the abort kills
  it, and what it prints after its pipe was read is in the pipe when the abort reaches the
  launcher: a rank printing a line every 0.6 ms lost the lines of the last 1-12 ms before
  its kill (7 of its lines, in 4 jobs of 14; the kill comes 5-12 ms after ``MPI_Abort``).
  :func:`hold` therefore makes the process's later writes to its pipes wait, in the kernel,
  before it waits until the launcher has read them: what returned from ``print`` was read,
  and what did not is not printed. :func:`release` lets them go on (a held rank that the
  abort has not ended after :data:`HOLD_LIMIT` seconds).
- The other ranks: the stall inspector asks each rank to hold its output and to wait until
  it is read (:func:`jaxddp._runtime.watchdog.abort_job`).
"""

from __future__ import annotations

import array
import atexit
import contextlib
import fcntl
import io
import os
import stat
import sys
import termios
import threading
import time

__all__ = ["HOLD_LIMIT", "flush", "hold", "holding", "line_buffered", "release", "wait_until_read"]

POLL = 0.001  # seconds between two looks at what the launcher has not read yet
HOLD_LIMIT = 10.0  # seconds a rank holds its output for an abort that does not come
_CAPTURE_BYTES = 1 << 20  # room for what Python holds of a line when the output is held


def line_buffered() -> None:
    """Makes the process's stdout and stderr write each line as it is printed, in one
    write (a few microseconds a line): line buffering on, writing through off (a partial
    line waits for its newline or a flush). ``sys.stdout.reconfigure(line_buffering=False)``
    afterwards gives the block buffer back, and with it the risk of losing lines in an
    abort."""
    for stream in {id(s): s for s in (sys.__stdout__, sys.__stderr__)}.values():
        if isinstance(stream, io.TextIOWrapper) and (
            not stream.line_buffering or stream.write_through
        ):
            with contextlib.suppress(Exception):  # a closed or detached stream
                stream.reconfigure(line_buffering=True, write_through=False)


def flush() -> None:
    """Flushes this process's stdout and stderr, never raising (a closed stream, a pipe
    whose reader is gone)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


# -- holding the output -------------------------------------------------------------------

_held: dict[int, tuple[int, int, int]] = {}  # fd -> (the launcher's pipe, blocker's ends)
_hold_lock = threading.Lock()


def holding() -> bool:
    """Whether this process's output is held (:func:`hold`)."""
    return bool(_held)


def hold(fds: tuple[int, ...] = (1, 2), *, limit: float | None = None) -> None:
    """Holds this process's output to the pipes among ``fds`` (stdout, stderr): what Python
    holds of a line is written first, ended with a newline if it had none (so that no
    other rank's line joins it), then every later write to them (Python's, or C code's)
    waits in the kernel until :func:`release` (by itself after ``limit`` seconds, when
    given), or until the abort ends the process. Any thread may call it; a call while the
    output is held does nothing."""
    with _hold_lock:
        if _held:
            return
        if limit is not None:
            timer = threading.Timer(limit, release)
            timer.daemon = True
            timer.start()
        prepared: list[tuple[int, int, int, int, int, int]] = []
        try:  # every descriptor first: nothing is redirected unless all could be made
            for fd in fds:
                if _is_pipe(fd):
                    prepared.append((fd, os.dup(fd), *os.pipe(), *_full_pipe()))
        except OSError:
            for made in prepared:
                for other in made[1:]:
                    os.close(other)
            raise
        for fd, _, _, capture_in, _, _ in prepared:
            with contextlib.suppress(OSError):
                fcntl.fcntl(capture_in, _SETPIPE_SZ, _CAPTURE_BYTES)
            os.dup2(capture_in, fd)
        flush()  # what Python holds goes into the captures, not to the launcher yet
        for fd, launcher, capture_out, capture_in, blocker_out, blocker_in in prepared:
            os.dup2(blocker_in, fd)  # from here on, a write to fd waits
            os.close(capture_in)
            pending = _read_all(capture_out)  # to its end: writes begun before are in
            os.close(capture_out)
            if pending and not pending.endswith(b"\n"):
                pending += b"\n"
            _write_all(launcher, pending)
            _held[fd] = (launcher, blocker_out, blocker_in)


def release(fds: tuple[int, ...] = (1, 2)) -> None:
    """Lets held writes to ``fds`` go on: the pipes are given back, and what waited is
    passed on to them by a thread of its own."""
    with _hold_lock:
        for fd in fds:
            if fd not in _held:
                continue
            launcher, blocker_out, blocker_in = _held.pop(fd)
            os.dup2(launcher, fd)
            os.close(blocker_in)  # the writes that wait hold it open until they are done
            relay = threading.Thread(
                target=_pass_on, args=(blocker_out, launcher), name="jaxddp output", daemon=True
            )
            relay.start()
            if not _relays:
                atexit.register(_finish_relays)
            _relays.append(relay)


_relays: list[threading.Thread] = []


def _finish_relays() -> None:
    """At exit: lets the threads passing on released output finish (at most a second)."""
    deadline = time.monotonic() + 1.0
    for relay in _relays:
        relay.join(max(0.0, deadline - time.monotonic()))


_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_FILLER = b"\0"  # what a blocker is filled with: never passed on


def _is_pipe(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


def _full_pipe() -> tuple[int, int]:
    """A pipe filled to the last byte: a write to it waits until it is read."""
    out, into = os.pipe()
    os.set_blocking(into, False)
    for size in (65536, 4096, 1):
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(into, _FILLER * size)
    os.set_blocking(into, True)
    return out, into


def _read_all(fd: int) -> bytes:
    parts = []
    while chunk := os.read(fd, 65536):
        parts.append(chunk)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]


def _pass_on(blocker: int, launcher: int) -> None:
    """Reads a released blocker to its end; passes on what the held writes wrote after
    its filler."""
    skip = _unread(blocker)  # the filler: the held writes wait behind it
    data = _read_all(blocker)[skip:]
    _write_all(launcher, data)
    os.close(blocker)
    os.close(launcher)


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
    Streams that are not pipes (a file, a terminal) have nothing to wait for. While the
    output is held, the launcher's pipes are looked at, not the blockers."""
    pipes = [_held[fd][0] if fd in _held else fd for fd in (1, 2)]
    pipes = [fd for fd in pipes if _is_pipe(fd)]
    deadline = time.monotonic() + seconds
    while True:
        pipes = [fd for fd in pipes if _unread(fd) > 0]
        if not pipes:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)
