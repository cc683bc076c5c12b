"""The verdict: does the launcher offer what the library speaks? A launcher x library matrix."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from .kinds import Kind, Launch
from .library import PMI12, Family, Library

__all__ = ["Verdict", "judge"]


class Verdict(enum.StrEnum):
    """A launcher check's verdict; compares equal to its value, e.g. ``"ok"``."""

    OK = "ok"
    DOUBTFUL = "doubtful"  # a LauncherWarning: jaxddp cannot tell
    MISMATCH = "mismatch"  # a LauncherMismatchError unless forced


def judge(launch: Launch, lib: Library, env: Mapping[str, str]) -> tuple[Verdict, str]:
    """The decision matrix: (verdict, reason in sentences)."""
    if launch.kind is Kind.NONE:
        return Verdict.OK, "No launcher started this process: it is a world of 1 rank."
    if launch.kind is Kind.SRUN and not launch.pmi12 and not launch.pmix:
        return _srun_without_pmi(launch)
    if lib.family is Family.OPENMPI:
        return _openmpi(launch, lib, env)
    if lib.family is Family.MPICH:
        return _mpich(launch, lib, env)
    many = launch.world_size is None or launch.world_size > 1
    return (Verdict.DOUBTFUL if many else Verdict.OK), (
        f"jaxddp does not recognise the MPI library ({lib.head!r}), so it cannot tell "
        f"whether it speaks what {launch.name} offers ({launch.offers})."
    )


def _srun_without_pmi(launch: Launch) -> tuple[Verdict, str]:
    if launch.world_size is not None and launch.world_size > 1:
        return Verdict.MISMATCH, (
            f"srun started {launch.world_size} tasks without any PMI plugin (--mpi=none): "
            "no MPI library can find its peers that way, so every task would start as rank "
            "0 of 1 and train alone."
        )
    return Verdict.OK, "srun started a single task: it is a world of 1 rank."


def _openmpi(launch: Launch, lib: Library, env: Mapping[str, str]) -> tuple[Verdict, str]:
    major = lib.major if lib.vendor == "Open MPI" else None
    if not launch.pmix:
        if launch.kind is Kind.SRUN and (major is None or major < 5):
            return Verdict.DOUBTFUL, (
                f"{launch.name} offers {PMI12}; {lib.name} can use it only if it was built "
                "with Slurm's PMI-2 support (`--with-pmi`), which Open MPI 5 no longer has."
            )
        return Verdict.MISMATCH, (
            f"{lib.name} speaks only PMIx, but {launch.name} offers {launch.offers}: "
            "MPI_Init would abort or every process would start as rank 0 of 1."
        )
    if "PRTE_LAUNCHED" in env and major is not None and major < 5:
        return Verdict.MISMATCH, (
            f"{lib.name} predates PRRTE, the run-time of the Open MPI 5 mpiexec that launched "
            "this process: its ORTE run-time finds no daemon it knows and MPI_Init aborts."
        )
    return Verdict.OK, f"{launch.name} offers PMIx, which {lib.name} speaks."


def _mpich(launch: Launch, lib: Library, env: Mapping[str, str]) -> tuple[Verdict, str]:
    if launch.pmi12:
        return Verdict.OK, f"{launch.name} offers {PMI12}, which {lib.name} speaks."
    if launch.pmix:
        return _mpich_under_pmix(launch, lib, env)
    if launch.kind in (Kind.PALS, Kind.MVAPICH):
        return Verdict.OK, f"{launch.name} starts {lib.name} through its own PMI."
    many = launch.world_size is None or launch.world_size > 1
    return (Verdict.DOUBTFUL if many else Verdict.OK), (
        f"{launch.name} set PMI_RANK/PMI_SIZE but neither PMI_FD nor PMI_PORT, so {lib.name} "
        "has no PMI server to connect to unless it was built for this launcher (Cray PMI, "
        "say); it may start as rank 0 of 1."
    )


def _mpich_under_pmix(launch: Launch, lib: Library, env: Mapping[str, str]) -> tuple[Verdict, str]:
    """An MPICH-family library under a launcher that offers only PMIx."""
    if lib.pmix:
        return Verdict.OK, f"{launch.name} offers PMIx, and {lib.name} was built with PMIx."
    if lib.vendor == "Intel MPI" and env.get("I_MPI_PMI_LIBRARY"):
        return Verdict.OK, (
            f"{launch.name} offers PMIx, and I_MPI_PMI_LIBRARY points {lib.name} at a "
            f"PMI library ({env['I_MPI_PMI_LIBRARY']})."
        )
    if lib.vendor == "Intel MPI" and launch.kind is Kind.SRUN:
        year = lib.major
        return (Verdict.OK if year is not None and year >= 2021 else Verdict.DOUBTFUL), (
            f"{launch.name} offers PMIx; Intel MPI 2021 and later find Slurm's PMIx library "
            f"by themselves (I_MPI_PMI_LIBRARY can name it for {lib.name})."
        )
    built = (
        "does not use PMIx unless I_MPI_PMI_LIBRARY names a PMIx library"
        if lib.vendor == "Intel MPI"
        else "was not built with PMIx"
    )
    return Verdict.MISMATCH, (
        f"{lib.name} speaks {PMI12} and {built}, but {launch.name} offers "
        'only PMIx: MPI_Init would abort ("unsupported PMI version PMIx", "PMI_Init '
        'returned -1") or every process would start as rank 0 of 1 and train alone.'
    )
