"""How the main thread asked to exit: ``sys.exit``'s status and where it was called.

Python hands ``atexit`` handlers no exit status, so :func:`install` wraps ``sys.exit`` (which
argparse's ``parser.error`` and most command-line libraries call) to remember the status and
the caller's ``file:line``. The fail-fast abort reads :data:`status` to end the job when a
rank exits non-zero after MPI started; the stall report shows :data:`where` for a rank that
left early. A bare ``raise SystemExit(1)`` is not seen here; the stall inspector still names
that rank as exited.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Any

from . import progress as _progress

__all__ = ["install", "status", "where"]

status: Any = None  # the argument of the main thread's last sys.exit call
where: str | None = None  # "file:line in function" of that call
_original: Any = None
_progress_then = -1  # jaxddp's progress count when sys.exit was called


def install() -> None:
    """Wraps ``sys.exit`` once; the wrapper records, then exits exactly as before."""
    global _original
    if _original is not None:
        return
    _original = sys.exit

    @functools.wraps(_original)
    def exit(status: Any = None, /) -> Any:
        if threading.current_thread() is threading.main_thread():
            _record(status, sys._getframe(1))
        return _original(status)

    sys.exit = exit


def _record(code: Any, frame: Any) -> None:
    global status, where, _progress_then
    status = code
    _progress_then = _progress.main_count
    name = frame.f_code.co_filename
    try:
        relative = os.path.relpath(name)
        name = name if relative.startswith("..") else relative
    except ValueError:
        pass
    where = f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"


def nonzero() -> int | None:
    """The process's exit status when ``sys.exit`` was called with a failure, else None.

    As Python itself: ``None`` and ``0`` are success, another integer is that status, any
    other object (a message) is status 1. A ``sys.exit`` whose SystemExit the program
    caught and went on from (jaxddp saw the main thread progress since: a batch, a
    collective, a heartbeat) is not the exit: None. (One caught and followed by no jaxddp call at all still counts;
    ``JAXDDP_ABORT_ON_ERROR=0`` turns the abort off.)
    """
    if status is None or status == 0 or _progress.main_count != _progress_then:
        return None
    return int(status) if isinstance(status, int) else 1
