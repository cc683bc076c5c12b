"""The checks: the pure :func:`check_launcher`, the process-wide :func:`guard` before
``MPI_Init``, and :func:`check_world_size`, the silent-singleton safety net after it."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from types import ModuleType

from ..._base import mpi as _mpi
from ..._base import settings as _settings
from .fixes import fixes
from .judge import Verdict, judge
from .kinds import detect, evidence
from .library import UNKNOWN_LIBRARY, parse_library
from .report import LauncherMismatchError, LauncherReport, LauncherWarning, compose

__all__ = ["check_launcher", "check_world_size", "guard"]


def check_launcher(
    environ: Mapping[str, str] | None = None,
    library: str | None = None,
    *,
    force: bool = False,
) -> LauncherReport:
    """Checks that the launcher offers the process-management interface the MPI library speaks.

    A pure function of the environment and the library's version string: it needs no MPI,
    and ``import jaxddp`` runs it before ``MPI_Init``.

    Args:
      environ: the process environment; ``os.environ`` by default.
      library: the text of ``MPI_Get_library_version`` (``MPI.Get_library_version()``); by
        default read from mpi4py, which is loaded without initializing MPI.
      force: return the report whatever the verdict, without raising or warning.

    Returns:
      A :class:`LauncherReport` naming the launcher, the interface it offers, the library
      and its version, the launcher's idea of the world size, and the verdict.

    Raises:
      LauncherMismatchError: the launcher and the library cannot work together (unless
        ``force``). Its message names what was found, why it cannot work, and the fixes.

    Warns:
      LauncherWarning: jaxddp cannot tell whether they work together (unless ``force``).

    Example:
      >>> import jaxddp
      >>> hydra = {"HYDI_CONTROL_FD": "7", "PMI_FD": "9", "PMI_RANK": "0", "PMI_SIZE": "2"}
      >>> report = jaxddp.check_launcher(hydra, "MPICH Version:      5.0.2\\n")
      >>> report.launcher, report.pmi, report.library_name, report.world_size
      ('MPICH mpiexec (hydra)', 'PMI-1/2', 'MPICH 5.0.2', 2)
      >>> report.verdict == "ok"
      True
      >>> openmpi = {"PRTE_LAUNCHED": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "0"}
      >>> report = jaxddp.check_launcher(openmpi, "MPICH Version: 5.0.2\\n", force=True)
      >>> print(report.pmi, report.verdict)
      PMIx mismatch
      >>> try:
      ...     jaxddp.check_launcher(openmpi, "MPICH Version: 5.0.2\\n")
      ... except jaxddp.LauncherMismatchError as e:
      ...     print(str(e).splitlines()[0])
      jaxddp: the launcher does not match the MPI library; refusing to start MPI.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if library is None:
        library = _mpi.library_version()
    report = _report(env, library)
    if not force:
        _act(report, stacklevel=3)
    return report


def _report(env: Mapping[str, str], library: str) -> LauncherReport:
    launch = detect(env)
    lib = parse_library(library)
    verdict, reason = judge(launch, lib, env)
    found = fixes(launch, lib, env, _settings.SkipLevel.NONE) if verdict != Verdict.OK else ()
    return LauncherReport(
        launcher=launch.name,
        pmi=launch.offers,
        library=lib.vendor,
        library_version=lib.version,
        library_pmi=lib.speaks,
        world_size=launch.world_size,
        world_size_source=launch.world_size_source,
        rank=launch.rank,
        verdict=verdict,
        reason=reason,
        fixes=found,
        evidence=evidence(env),
    )


def _act(report: LauncherReport, stacklevel: int) -> None:
    if report.verdict is Verdict.MISMATCH:
        raise LauncherMismatchError(report.message())
    if report.verdict is Verdict.DOUBTFUL:
        warnings.warn(report.message(), LauncherWarning, stacklevel=stacklevel)


_cached: LauncherReport | None = None


def guard(MPI: ModuleType) -> None:
    """Checks the launcher against the loaded MPI library before ``MPI_Init``.

    Runs at ``import jaxddp`` and again right before jaxddp initializes MPI. The first call
    reads the environment and the library string; later calls reuse that verdict (a
    mismatch is raised again, a warning is not repeated). ``JAXDDP_SKIP_LAUNCHER_CHECK=1``
    skips it; when MPI is already initialized, :func:`check_world_size` judges instead.
    """
    global _cached
    skip = _settings.skip_launcher_check() is not _settings.SkipLevel.NONE
    if _cached is not None:
        if _cached.verdict is Verdict.MISMATCH and not skip:
            raise LauncherMismatchError(_cached.message())
        return
    if skip or MPI.Is_initialized():
        return
    _cached = _report(os.environ, str(MPI.Get_library_version()))
    _act(_cached, stacklevel=3)


def check_world_size(size: int, environ: Mapping[str, str] | None = None) -> None:
    """After ``MPI_Init``: refuses a world of 1 when the launcher announced more.

    This is the safety net for what :func:`guard` could not foresee (or was told to skip):
    N processes that each believe they are rank 0 of 1 would train N separate models.
    ``JAXDDP_SKIP_LAUNCHER_CHECK=all`` turns it off.

    Example:
      >>> from jaxddp._runtime import launcher
      >>> launcher.check_world_size(1, {})  # no launcher: a world of 1 is right
      >>> try:
      ...     launcher.check_world_size(1, {"HYDI_CONTROL_FD": "7", "PMI_SIZE": "2"})
      ... except launcher.LauncherMismatchError as e:
      ...     print(str(e).splitlines()[0])
      jaxddp: MPI started this process as rank 0 of 1, but the launcher started 2 processes.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if size != 1 or _settings.skip_launcher_check(env) is _settings.SkipLevel.ALL:
        return
    launch = detect(env)
    if launch.world_size is None or launch.world_size <= 1:
        return
    library = _loaded_library_text()
    lib = parse_library(library) if library else UNKNOWN_LIBRARY
    n = launch.world_size
    rows = [
        ("launcher", launch.name),
        ("PMI offered", launch.offers),
        ("MPI library", f"{lib.name} (speaks {lib.speaks})"),
        (
            "world size",
            f"{n} according to the launcher ({launch.world_size_source}), 1 according to MPI",
        ),
    ]
    reason = (
        "Each process is a silent singleton: the MPI library did not connect to the "
        f"launcher, so {n} copies would each train alone."
    )
    head = (
        f"jaxddp: MPI started this process as rank 0 of 1, but the launcher started {n} processes."
    )
    fixed = fixes(launch, lib, env, _settings.SkipLevel.ALL)
    raise LauncherMismatchError(compose(head, rows, reason, fixed))


def _loaded_library_text() -> str:
    """The library string if mpi4py is loaded (never loads it: this is only for a message)."""
    if "mpi4py.MPI" not in sys.modules:
        return ""
    try:
        return str(sys.modules["mpi4py.MPI"].Get_library_version())
    except Exception:  # noqa: BLE001 - only for a message
        return ""
