"""The launcher guard: does the launcher speak the process-management interface of the MPI
library that mpi4py loaded? (Interface only; the decision matrix lands with issue 3.)"""

from __future__ import annotations

from types import ModuleType


class LauncherMismatchError(RuntimeError):
    """The launcher and the MPI library cannot work together."""


def guard(MPI: ModuleType) -> None:
    """Checks the launcher against the loaded MPI library before ``MPI_Init``."""
    del MPI


def check_world_size(size: int) -> None:
    """After ``MPI_Init``: refuses a world of 1 when the launcher announced more."""
    del size
