"""Which launcher started this process: one record per launcher kind, read from the environment.

Adding a launcher is adding one :class:`LauncherKind` to :data:`KINDS`: its name, the
variables holding the world size and the rank, its sign (a test of the environment), its
priority (the most specific sign wins: a launcher run inside another job, hydra inside an
srun step say, inherits the outer job's variables too) and the variables a report shows.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping

from .library import PMI12, PMIX

__all__ = ["KINDS", "LIBRARY_EVIDENCE", "Kind", "Launch", "LauncherKind", "detect", "evidence"]

Env = Mapping[str, str]


class Kind(enum.Enum):
    """A kind of launcher; ``NONE`` when no launcher started this process."""

    NONE = "none"
    OPENMPI_PRRTE = "openmpi-prrte"
    OPENMPI_ORTE = "openmpi-orte"
    OPENMPI = "openmpi"
    INTEL = "intel"
    HYDRA = "hydra"
    SRUN = "srun"
    PMIX = "pmix"
    MVAPICH = "mvapich"
    GFORKER = "gforker"
    PMI = "pmi"
    PALS = "pals"
    PMI_VARS = "pmi-vars"

    @property
    def is_openmpi(self) -> bool:
        """Open MPI's own launcher (mpirun or mpiexec, either run-time)."""
        return self in (Kind.OPENMPI_PRRTE, Kind.OPENMPI_ORTE, Kind.OPENMPI)


def offers_pmi12(env: Env) -> bool:
    """A PMI-1/2 server to connect to: ``PMI_FD``, or ``PMI_PORT`` with ``PMI_ID``."""
    return "PMI_FD" in env or ("PMI_PORT" in env and "PMI_ID" in env)


def offers_pmix(env: Env) -> bool:
    return "PMIX_NAMESPACE" in env or "PMIX_RANK" in env


def _pmi_vars(env: Env) -> bool:
    return "PMI_RANK" in env or "PMI_SIZE" in env


_INTEL_HYDRA = ("I_MPI_HYDRA_", "HYDRA_BSTRAP_")


@dataclasses.dataclass(frozen=True)
class LauncherKind:
    """One launcher: how to recognise it and where it says the world size and the rank.

    ``name`` may hold ``{plugin}``, filled with the PMI plugin an ``srun`` step offers.
    """

    kind: Kind
    name: str
    sizes: tuple[str, ...]
    ranks: tuple[str, ...]
    sign: Callable[[Env], bool]
    priority: int
    evidence: tuple[str, ...] = ()


_HYDRA_SIZES = ("PMI_SIZE", "MPI_LOCALNRANKS")
_PMI_RANKS = ("PMI_RANK", "PMI_ID")

# In the order reports list their evidence; the priority decides which launcher it is.
KINDS = (
    LauncherKind(
        Kind.OPENMPI_PRRTE,
        "Open MPI mpiexec (PRRTE, Open MPI 5 or later)",
        ("OMPI_COMM_WORLD_SIZE",),
        ("OMPI_COMM_WORLD_RANK",),
        lambda env: "PRTE_LAUNCHED" in env,
        priority=1,
        evidence=("PRTE_LAUNCHED",),
    ),
    LauncherKind(
        Kind.OPENMPI,
        "Open MPI mpirun",
        ("OMPI_COMM_WORLD_SIZE",),
        ("OMPI_COMM_WORLD_RANK",),
        lambda env: "OMPI_COMM_WORLD_SIZE" in env,
        priority=3,
        evidence=("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_VERSION"),
    ),
    LauncherKind(
        Kind.OPENMPI_ORTE,
        "Open MPI mpirun (ORTE, Open MPI 4 or earlier)",
        ("OMPI_COMM_WORLD_SIZE",),
        ("OMPI_COMM_WORLD_RANK",),
        lambda env: "OMPI_MCA_orte_hnp_uri" in env,
        priority=2,
        evidence=("OMPI_MCA_orte_hnp_uri",),
    ),
    LauncherKind(
        Kind.PMIX,
        "a PMIx launcher",
        (),
        ("PMIX_RANK",),
        offers_pmix,
        priority=7,
        evidence=("PMIX_NAMESPACE", "PMIX_RANK", "PMIX_VERSION"),
    ),
    LauncherKind(
        Kind.HYDRA,
        "MPICH mpiexec (hydra)",
        _HYDRA_SIZES,
        _PMI_RANKS,
        lambda env: "HYDI_CONTROL_FD" in env,
        priority=5,
        evidence=("HYDI_CONTROL_FD",),
    ),
    LauncherKind(
        Kind.INTEL,
        "Intel MPI mpiexec (hydra)",
        _HYDRA_SIZES,
        _PMI_RANKS,
        lambda env: (
            (offers_pmi12(env) or _pmi_vars(env)) and any(k.startswith(_INTEL_HYDRA) for k in env)
        ),
        priority=4,
        evidence=("I_MPI_HYDRA_UUID", "HYDRA_BSTRAP_LAUNCHER"),
    ),
    LauncherKind(
        Kind.PMI,
        "a PMI-1/2 launcher",
        ("PMI_SIZE",),
        _PMI_RANKS,
        offers_pmi12,
        priority=10,
        evidence=("PMI_FD", "PMI_PORT", "PMI_ID", "PMI_RANK", "PMI_SIZE", "PMI_JOBID"),
    ),
    LauncherKind(
        Kind.GFORKER,
        "MPICH mpiexec.gforker",
        ("PMI_SIZE",),
        ("PMI_RANK",),
        lambda env: "PMI_FD" in env and "PMI_DEBUG" in env,
        priority=9,
        evidence=("MPI_LOCALNRANKS",),  # hydra's, listed here to keep the reports' order
    ),
    LauncherKind(
        Kind.MVAPICH,
        "MVAPICH mpirun_rsh",
        ("MV2_COMM_WORLD_SIZE",),
        ("MV2_COMM_WORLD_RANK",),
        lambda env: "MV2_COMM_WORLD_SIZE" in env,
        priority=8,
        evidence=("MV2_COMM_WORLD_SIZE",),
    ),
    LauncherKind(
        Kind.PALS,
        "Cray PALS (mpiexec or aprun)",
        ("PMI_SIZE",),
        ("PALS_RANKID", "PMI_RANK"),
        lambda env: "PALS_RANKID" in env,
        priority=11,
        evidence=("PALS_RANKID",),
    ),
    LauncherKind(
        Kind.SRUN,
        "srun --mpi={plugin}",
        ("PMI_SIZE", "SLURM_STEP_NUM_TASKS"),
        ("PMI_RANK", "SLURM_PROCID"),
        lambda env: "SLURM_STEP_ID" in env or "SLURM_STEPID" in env,
        priority=6,
        evidence=("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
    ),
    LauncherKind(
        Kind.PMI_VARS,
        "a launcher that set PMI_RANK/PMI_SIZE without a PMI connection",
        ("PMI_SIZE",),
        ("PMI_RANK",),
        _pmi_vars,
        priority=12,
    ),
)

# Library settings that decide too (Intel MPI's choice of PMI), shown after the launcher's.
LIBRARY_EVIDENCE = ("I_MPI_PMI", "I_MPI_PMI_LIBRARY")

_BY_PRIORITY = sorted(KINDS, key=lambda k: k.priority)
_EVIDENCE = tuple(dict.fromkeys(v for k in KINDS for v in k.evidence)) + LIBRARY_EVIDENCE


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the environment says about the launch: who, what it offers, how many, which."""

    name: str
    kind: Kind
    pmi12: bool
    pmix: bool
    world_size: int | None
    world_size_source: str
    rank: int | None

    @property
    def offers(self) -> str:
        """The interface offered, as reports print it."""
        if self.pmi12 and self.pmix:
            return f"{PMI12} and {PMIX}"
        return PMI12 if self.pmi12 else PMIX if self.pmix else "none"


def _int(env: Env, name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _first_int(env: Env, names: tuple[str, ...]) -> tuple[int | None, str]:
    for name in names:
        value = _int(env, name)
        if value is not None:
            return value, name
    return None, ""


def detect(env: Env) -> Launch:
    """Which launcher started this process, what it offers, and how many it started."""
    pmi12, pmix = offers_pmi12(env), offers_pmix(env)
    found = next((k for k in _BY_PRIORITY if k.sign(env)), None)
    if found is None:
        name = "none"
        if "SLURM_JOB_ID" in env:
            name = f"none (a shell inside Slurm job {env['SLURM_JOB_ID']}, not an srun step)"
        return Launch(name, Kind.NONE, False, False, None, "", None)
    plugin = "pmi2 or pmix" if pmix and pmi12 else "pmix" if pmix else "pmi2" if pmi12 else "none"
    size, source = _first_int(env, found.sizes)
    if source == "MPI_LOCALNRANKS":
        source = "MPI_LOCALNRANKS: the ranks on this node, so at least that many"
    rank, _ = _first_int(env, (*found.ranks, "PMIX_RANK"))
    return Launch(found.name.format(plugin=plugin), found.kind, pmi12, pmix, size, source, rank)


def evidence(env: Env) -> tuple[str, ...]:
    """The deciding variables that are set, as ``NAME=value`` (long values shortened)."""
    out = []
    for name in _EVIDENCE:
        if name in env:
            value = env[name]
            out.append(f"{name}={value[:40] + '...' if len(value) > 40 else value}")
    return tuple(out)
