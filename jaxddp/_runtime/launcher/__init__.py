"""The launcher guard: does the launcher speak the process-management interface (PMI) of the
MPI library that mpi4py loaded?

An MPI library finds its rank and its peers through the launcher: MPICH, Intel MPI and
MVAPICH speak PMI-1/2 (``PMI_FD``, ``PMI_PORT``), Open MPI speaks only PMIx (``PMIX_*``).
When the two do not match, ``MPI_Init`` either aborts with a message about PMI versions or,
worse, every process starts as "rank 0 of 1" and trains alone. :func:`check_launcher` decides
from the environment and the library's version string alone, before ``MPI_Init``;
:func:`check_world_size` catches, after ``MPI_Init``, the silent singletons that slipped
through.

The parts, each a pure function of strings: :mod:`.library` (the library string),
:mod:`.kinds` (one record per launcher), :mod:`.judge` (the verdict), :mod:`.fixes` (what to
do), :mod:`.report` (the report and its one renderer), :mod:`.checks` (the checks and the
process-wide guard). Only :mod:`jaxddp._base.mpi` and :mod:`jaxddp._base.settings` are used
from outside.
"""

from .checks import check_launcher as check_launcher
from .checks import check_world_size as check_world_size
from .checks import guard as guard
from .fixes import loaded_libmpi as loaded_libmpi
from .judge import Verdict as Verdict
from .kinds import Kind as Kind
from .library import Library as Library
from .library import parse_library as parse_library
from .report import LauncherMismatchError as LauncherMismatchError
from .report import LauncherReport as LauncherReport
from .report import LauncherWarning as LauncherWarning
from .report import fix_lines as fix_lines
from .report import table_lines as table_lines
from .report import wrap as wrap

__all__ = [
    "Kind",
    "LauncherMismatchError",
    "LauncherReport",
    "LauncherWarning",
    "Library",
    "Verdict",
    "check_launcher",
    "check_world_size",
    "fix_lines",
    "guard",
    "loaded_libmpi",
    "parse_library",
    "table_lines",
    "wrap",
]
