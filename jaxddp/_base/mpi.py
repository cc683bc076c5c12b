"""Loading mpi4py, so that the launcher check can run before ``MPI_Init``; a leaf module.

It imports nothing of jaxddp. :func:`load` imports ``mpi4py.MPI`` without initializing MPI
(``mpi4py.rc.initialize = False`` for the duration of the import) and remembers whether the
program asked to keep MPI uninitialized itself. :func:`initialize` then starts MPI the way
``from mpi4py import MPI`` would have (``MPI_THREAD_MULTIPLE``, finalized at exit), so a
program that imports jaxddp sees MPI exactly as after importing mpi4py.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType

__all__ = [
    "c_handle",
    "initialize",
    "is_initialized",
    "library_version",
    "load",
    "program_initializes",
]

_lock = threading.Lock()
_program_initializes: bool | None = None  # decided once, when mpi4py.MPI is first loaded

_NO = (False, "no", "0", "false", "off")


def _mpi4py_told_not_to_initialize() -> bool:
    """Whether the program set ``mpi4py.rc.initialize = False`` (or ``MPI4PY_RC_INITIALIZE``)."""
    value = os.environ.get("MPI4PY_RC_INITIALIZE")
    if value is not None:
        return value.strip().lower() in _NO
    rc = getattr(sys.modules.get("mpi4py"), "rc", None)
    return rc is not None and rc.initialize in _NO


def load() -> ModuleType:
    """``mpi4py.MPI``, imported without initializing MPI if nobody imported it yet.

    Finalization at exit stays as mpi4py would set it for a program that let it initialize
    MPI (on), unless the program chose ``mpi4py.rc.finalize`` itself.
    """
    global _program_initializes
    if _program_initializes is not None:
        return sys.modules["mpi4py.MPI"]
    with _lock:
        if _program_initializes is None:
            already = "mpi4py.MPI" in sys.modules
            told = _mpi4py_told_not_to_initialize()
            if not already:
                import mpi4py

                initialize, finalize = mpi4py.rc.initialize, mpi4py.rc.finalize
                mpi4py.rc.initialize = False
                if finalize is None:
                    mpi4py.rc.finalize = True  # whoever initializes, MPI is finalized at exit
                try:
                    from mpi4py import MPI
                finally:
                    mpi4py.rc.initialize = initialize
            from mpi4py import MPI

            # The program keeps control when it told mpi4py not to initialize, or when it
            # imported mpi4py.MPI uninitialized itself.
            _program_initializes = told or (already and not MPI.Is_initialized())
    return sys.modules["mpi4py.MPI"]


def program_initializes() -> bool:
    """True when the program asked to initialize MPI itself (``rc.initialize = False``).

    jaxddp then leaves MPI uninitialized at import and initializes it on first use.
    """
    load()
    return bool(_program_initializes)


def is_initialized() -> bool:
    """Whether ``MPI_Init`` has run in this process (by jaxddp, mpi4py or the program)."""
    return bool(load().Is_initialized())


def library_version() -> str:
    """``MPI_Get_library_version``'s text, read without initializing MPI."""
    return str(load().Get_library_version())


def initialize() -> None:
    """``MPI_Init_thread(MPI_THREAD_MULTIPLE)`` unless MPI is initialized already."""
    MPI = load()
    with _lock:
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)


def c_handle(obj: object) -> int:
    """An MPI object's C handle as a signed 64-bit integer, as compiled code receives it."""
    from mpi4py import MPI

    handle = MPI._handleof(obj)  # pyright: ignore[reportAttributeAccessIssue]
    # MPICH's handles are 32-bit signed: mpi4py may hand them back sign-extended.
    return handle - (1 << 64) if handle >= (1 << 63) else handle
