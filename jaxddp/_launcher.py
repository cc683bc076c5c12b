"""The launcher guard: does the launcher speak the process-management interface (PMI) of the
MPI library that mpi4py loaded?

An MPI library finds its rank and its peers through the launcher: MPICH, Intel MPI and
MVAPICH speak PMI-1/2 (``PMI_FD``, ``PMI_PORT``), Open MPI speaks only PMIx (``PMIX_*``).
When the two do not match, ``MPI_Init`` either aborts with a message about PMI versions or,
worse, every process starts as "rank 0 of 1" and trains alone. :func:`check_launcher` decides
from the environment and the library's version string alone, before ``MPI_Init``;
:func:`check_world_size` catches, after ``MPI_Init``, the silent singletons that slipped
through.

The decision is pure Python on strings: no MPI call is made, and mpi4py is touched only to
read the library string when the caller does not hand it over.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
import textwrap
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

__all__ = [
    "SKIP_VARIABLE",
    "LauncherMismatchError",
    "LauncherReport",
    "LauncherWarning",
    "check_launcher",
    "check_world_size",
    "guard",
]

SKIP_VARIABLE = "JAXDDP_SKIP_LAUNCHER_CHECK"

Verdict = Literal["ok", "doubtful", "mismatch"]

_PMI12 = "PMI-1/2"
_PMIX = "PMIx"

# Variables that decide, shown in reports as evidence (in this order, when present).
_EVIDENCE = (
    "PRTE_LAUNCHED",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_VERSION",
    "OMPI_MCA_orte_hnp_uri",
    "PMIX_NAMESPACE",
    "PMIX_RANK",
    "PMIX_VERSION",
    "HYDI_CONTROL_FD",
    "I_MPI_HYDRA_UUID",
    "HYDRA_BSTRAP_LAUNCHER",
    "PMI_FD",
    "PMI_PORT",
    "PMI_ID",
    "PMI_RANK",
    "PMI_SIZE",
    "PMI_JOBID",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_SIZE",
    "PALS_RANKID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "I_MPI_PMI",
    "I_MPI_PMI_LIBRARY",
)


class LauncherMismatchError(RuntimeError):
    """The launcher and the MPI library cannot work together.

    Raised before ``MPI_Init`` when the launcher does not offer the process-management
    interface that the MPI library speaks, and after ``MPI_Init`` when MPI reports a world
    of 1 although the launcher started more processes (a "silent singleton").
    """


class LauncherWarning(UserWarning):
    """The launcher and the MPI library may not work together; jaxddp cannot tell for sure."""


@dataclasses.dataclass(frozen=True)
class LauncherReport:
    """What :func:`check_launcher` found, and its verdict.

    Attributes:
      launcher: the launcher that started this process, e.g. ``"MPICH mpiexec (hydra)"``,
        ``"Open MPI mpiexec (PRRTE, Open MPI 5 or later)"``, ``"srun --mpi=pmi2"``; ``"none"`` without one.
      pmi: the process-management interface the launcher offers: ``"PMI-1/2"``,
        ``"PMIx"``, ``"PMI-1/2 and PMIx"`` or ``"none"``.
      library: the MPI library's vendor (``"MPICH"``, ``"Open MPI"``, ``"Intel MPI"``,
        ``"MVAPICH"``, ``"Cray MPICH"``, ...), ``"unknown"`` when not recognised.
      library_version: its version, ``""`` when unknown.
      library_pmi: the interface the library speaks: ``"PMI-1/2"``, ``"PMIx"`` or
        ``"PMI-1/2 and PMIx"`` (an MPICH built with PMIx); ``"unknown"``.
      world_size: how many processes the launcher says it started, ``None`` when it does
        not say (no launcher, or ``srun --mpi=pmix``).
      world_size_source: the variable ``world_size`` was read from, e.g. ``"PMI_SIZE"``.
      rank: this process's rank according to the launcher, ``None`` when it does not say.
      verdict: ``"ok"``, ``"doubtful"`` (a :class:`LauncherWarning`) or ``"mismatch"``
        (a :class:`LauncherMismatchError` unless forced).
      reason: why, in sentences.
      fixes: what to do about it, most direct first; empty when the verdict is ``"ok"``.
      evidence: the deciding environment variables, as ``NAME=value``.
    """

    launcher: str
    pmi: str
    library: str
    library_version: str
    library_pmi: str
    world_size: int | None
    world_size_source: str
    rank: int | None
    verdict: Verdict
    reason: str
    fixes: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """False only for a mismatch: ``"doubtful"`` still lets jaxddp start."""
        return self.verdict != "mismatch"

    @property
    def library_name(self) -> str:
        """The library with its version, e.g. ``"MPICH 5.0.2"``."""
        return f"{self.library} {self.library_version}".strip()

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``jaxddp doctor --json``)."""
        out = dataclasses.asdict(self)
        out["fixes"] = list(self.fixes)
        out["evidence"] = list(self.evidence)
        return out

    def summary(self) -> str:
        """The report as an aligned table, one line per field."""
        size = "not announced" if self.world_size is None else str(self.world_size)
        if self.world_size_source:
            size += f" ({self.world_size_source})"
        rows = [
            ("launcher", self.launcher),
            ("PMI offered", self.pmi),
            ("MPI library", f"{self.library_name} (speaks {self.library_pmi})"),
            ("world size", size),
            ("verdict", self.verdict),
        ]
        if self.evidence:
            rows.append(("evidence", ", ".join(self.evidence)))
        return "\n".join(f"{k + ':':<13}{v}" for k, v in rows)

    def message(self) -> str:
        """The full text of a refusal or warning: what was found, why, and the fixes."""
        head = {
            "ok": "jaxddp: the launcher matches the MPI library.",
            "doubtful": "jaxddp: the launcher may not match the MPI library.",
            "mismatch": "jaxddp: the launcher does not match the MPI library; refusing to "
            "start MPI.",
        }[self.verdict]
        return _compose(head, self.summary(), self.reason, self.fixes)

    def __str__(self) -> str:
        return self.message()


def wrap(text: str, first: str = "", then: str = "") -> list[str]:
    """Wraps ``text`` to 100 columns, keeping paths and options whole."""
    return textwrap.wrap(
        text,
        width=100,
        initial_indent=first,
        subsequent_indent=then,
        break_on_hyphens=False,
        break_long_words=False,
    )


def _compose(head: str, table: str, reason: str, fixes: tuple[str, ...]) -> str:
    """A message: the head line, the table, the reason and the fixes, wrapped to 100."""
    lines = [head]
    for row in table.splitlines():
        lines += wrap(row, "  ", " " * 15)
    lines += wrap(reason, "  ", "  ")
    if fixes:
        lines.append("  How to fix it:")
        for fix in fixes:
            lines += wrap(fix, "  - ", "    ")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the library


@dataclasses.dataclass(frozen=True)
class _Library:
    vendor: str
    family: str  # "mpich" (MPICH and its derivatives), "openmpi", "unknown"
    version: str
    pmix: bool  # speaks PMIx (Open MPI always; an MPICH only when built with it)
    head: str = ""  # the first line of the version string

    @property
    def major(self) -> int | None:
        match = re.match(r"(\d+)", self.version)
        return int(match.group(1)) if match else None

    @property
    def speaks(self) -> str:
        if self.family == "openmpi":
            return _PMIX
        if self.family == "mpich":
            return f"{_PMI12} and {_PMIX}" if self.pmix else _PMI12
        return "unknown"

    @property
    def name(self) -> str:
        return f"{self.vendor} {self.version}".strip()


def _parse_library(text: str) -> _Library:
    """Vendor, family, version and PMIx support, from ``MPI_Get_library_version``'s text."""
    text = text.replace("\x00", "").strip()
    first = text.splitlines()[0] if text else ""
    pmix = "pmix" in text.lower()
    patterns = (
        (r"CRAY MPICH version (\S+)", "Cray MPICH", "mpich"),
        (r"MVAPICH2? Version\s*:\s*(\S+)", "MVAPICH", "mpich"),
        (r"MPICH Version\s*:\s*(\S+)", "MPICH", "mpich"),
        (r"Intel\(R\) MPI Library (\S+)", "Intel MPI", "mpich"),
        (r"Spectrum MPI\D*(\d\S*)", "IBM Spectrum MPI", "openmpi"),
        (r"Open MPI v(\d[^,\s]*)", "Open MPI", "openmpi"),
    )
    for pattern, vendor, family in patterns:
        match = re.search(pattern, text, re.IGNORECASE)
        if match:
            version = match.group(1).rstrip(",")
            return _Library(vendor, family, version, pmix or family == "openmpi", first)
    return _Library("unknown", "unknown", "", pmix, first[:80])


# ------------------------------------------------------------------------- the launcher


@dataclasses.dataclass(frozen=True)
class _Launch:
    name: str
    kind: str  # a key of _KINDS, or "none"
    pmi12: bool
    pmix: bool
    world_size: int | None
    world_size_source: str
    rank: int | None

    @property
    def offers(self) -> str:
        if self.pmi12 and self.pmix:
            return f"{_PMI12} and {_PMIX}"
        return _PMI12 if self.pmi12 else _PMIX if self.pmix else "none"


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[int | None, str]:
    for name in names:
        value = _int(env, name)
        if value is not None:
            return value, name
    return None, ""


# Launchers by kind: (name, variables holding the world size, variables holding the rank).
_KINDS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "openmpi": ("Open MPI mpirun", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_RANK",)),
    "intel": ("Intel MPI mpiexec (hydra)", ("PMI_SIZE", "MPI_LOCALNRANKS"), ("PMI_RANK", "PMI_ID")),
    "hydra": ("MPICH mpiexec (hydra)", ("PMI_SIZE", "MPI_LOCALNRANKS"), ("PMI_RANK", "PMI_ID")),
    "srun": ("srun", ("PMI_SIZE", "SLURM_STEP_NUM_TASKS"), ("PMI_RANK", "SLURM_PROCID")),
    "pmix": ("a PMIx launcher", (), ("PMIX_RANK",)),
    "mvapich": ("MVAPICH mpirun_rsh", ("MV2_COMM_WORLD_SIZE",), ("MV2_COMM_WORLD_RANK",)),
    "gforker": ("MPICH mpiexec.gforker", ("PMI_SIZE",), ("PMI_RANK",)),
    "pmi": ("a PMI-1/2 launcher", ("PMI_SIZE",), ("PMI_RANK", "PMI_ID")),
    "pals": ("Cray PALS (mpiexec or aprun)", ("PMI_SIZE",), ("PALS_RANKID", "PMI_RANK")),
    "pmi-vars": (
        "a launcher that set PMI_RANK/PMI_SIZE without a PMI connection",
        ("PMI_SIZE",),
        ("PMI_RANK",),
    ),
}


def _detect_launcher(env: Mapping[str, str]) -> _Launch:
    """Which launcher started this process, what it offers, and how many it started.

    The most specific sign wins: a launcher run inside another job (hydra inside an srun
    step, say) inherits the outer job's variables too.
    """
    pmi12 = "PMI_FD" in env or ("PMI_PORT" in env and "PMI_ID" in env)
    pmix = "PMIX_NAMESPACE" in env or "PMIX_RANK" in env
    pmi_vars = "PMI_RANK" in env or "PMI_SIZE" in env
    signs = (
        ("openmpi", any(k in env for k in ("PRTE_LAUNCHED", "OMPI_COMM_WORLD_SIZE"))),
        ("openmpi", "OMPI_MCA_orte_hnp_uri" in env),
        ("intel", (pmi12 or pmi_vars) and any(k.startswith(_INTEL_HYDRA) for k in env)),
        ("hydra", "HYDI_CONTROL_FD" in env),
        ("srun", "SLURM_STEP_ID" in env or "SLURM_STEPID" in env),
        ("pmix", pmix),
        ("mvapich", "MV2_COMM_WORLD_SIZE" in env),
        ("gforker", "PMI_FD" in env and "PMI_DEBUG" in env),
        ("pmi", pmi12),
        ("pals", "PALS_RANKID" in env),
        ("pmi-vars", pmi_vars),
    )
    kind = next((kind for kind, seen in signs if seen), "none")
    if kind == "none":
        name = "none"
        if "SLURM_JOB_ID" in env:
            name = f"none (a shell inside Slurm job {env['SLURM_JOB_ID']}, not an srun step)"
        return _Launch(name, kind, False, False, None, "", None)
    name, sizes, ranks = _KINDS[kind]
    if kind == "openmpi" and "PRTE_LAUNCHED" in env:
        name = "Open MPI mpiexec (PRRTE, Open MPI 5 or later)"
    elif kind == "openmpi" and "OMPI_MCA_orte_hnp_uri" in env:
        name = "Open MPI mpirun (ORTE, Open MPI 4 or earlier)"
    elif kind == "srun":
        plugin = (
            "pmi2 or pmix" if pmix and pmi12 else "pmix" if pmix else "pmi2" if pmi12 else "none"
        )
        name = f"srun --mpi={plugin}"
    size, source = _first_int(env, sizes)
    if source == "MPI_LOCALNRANKS":
        source = "MPI_LOCALNRANKS: the ranks on this node, so at least that many"
    rank, _ = _first_int(env, (*ranks, "PMIX_RANK"))
    return _Launch(name, kind, pmi12, pmix, size, source, rank)


_INTEL_HYDRA = ("I_MPI_HYDRA_", "HYDRA_BSTRAP_")


# ---------------------------------------------------------------------- the verdict


def _skip_level(env: Mapping[str, str]) -> str:
    """``""`` (check), ``"init"`` (skip the check before MPI_Init) or ``"all"``."""
    value = env.get(SKIP_VARIABLE, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return ""
    return "all" if value == "all" else "init"


def _evidence(env: Mapping[str, str]) -> tuple[str, ...]:
    out = []
    for name in _EVIDENCE:
        if name in env:
            value = env[name]
            out.append(f"{name}={value[:40] + '...' if len(value) > 40 else value}")
    return tuple(out)


def _judge(launch: _Launch, lib: _Library, env: Mapping[str, str]) -> tuple[Verdict, str]:
    """The decision matrix: (verdict, reason)."""
    if launch.kind == "none":
        return "ok", "No launcher started this process: it is a world of 1 rank."
    if launch.kind == "srun" and not launch.pmi12 and not launch.pmix:
        return _judge_srun_without_pmi(launch)
    if lib.family == "openmpi":
        return _judge_openmpi(launch, lib, env)
    if lib.family == "mpich":
        return _judge_mpich(launch, lib, env)
    many = launch.world_size is None or launch.world_size > 1
    return ("doubtful" if many else "ok"), (
        f"jaxddp does not recognise the MPI library ({lib.head!r}), so it cannot tell "
        f"whether it speaks what {launch.name} offers ({launch.offers})."
    )


def _judge_srun_without_pmi(launch: _Launch) -> tuple[Verdict, str]:
    if launch.world_size is not None and launch.world_size > 1:
        return "mismatch", (
            f"srun started {launch.world_size} tasks without any PMI plugin (--mpi=none): "
            "no MPI library can find its peers that way, so every task would start as rank "
            "0 of 1 and train alone."
        )
    return "ok", "srun started a single task: it is a world of 1 rank."


def _judge_openmpi(launch: _Launch, lib: _Library, env: Mapping[str, str]) -> tuple[Verdict, str]:
    major = lib.major if lib.vendor == "Open MPI" else None
    if not launch.pmix:
        if launch.kind == "srun" and (major is None or major < 5):
            return "doubtful", (
                f"{launch.name} offers {_PMI12}; {lib.name} can use it only if it was built "
                "with Slurm's PMI-2 support (`--with-pmi`), which Open MPI 5 no longer has."
            )
        return "mismatch", (
            f"{lib.name} speaks only PMIx, but {launch.name} offers {launch.offers}: "
            "MPI_Init would abort or every process would start as rank 0 of 1."
        )
    if "PRTE_LAUNCHED" in env and major is not None and major < 5:
        return "mismatch", (
            f"{lib.name} predates PRRTE, the run-time of the Open MPI 5 mpiexec that launched "
            "this process: its ORTE run-time finds no daemon it knows and MPI_Init aborts."
        )
    return "ok", f"{launch.name} offers PMIx, which {lib.name} speaks."


def _judge_mpich(launch: _Launch, lib: _Library, env: Mapping[str, str]) -> tuple[Verdict, str]:
    if launch.pmi12:
        return "ok", f"{launch.name} offers {_PMI12}, which {lib.name} speaks."
    if launch.pmix:
        return _judge_mpich_under_pmix(launch, lib, env)
    if launch.kind in ("pals", "mvapich"):
        return "ok", f"{launch.name} starts {lib.name} through its own PMI."
    many = launch.world_size is None or launch.world_size > 1
    return ("doubtful" if many else "ok"), (
        f"{launch.name} set PMI_RANK/PMI_SIZE but neither PMI_FD nor PMI_PORT, so {lib.name} "
        "has no PMI server to connect to unless it was built for this launcher (Cray PMI, "
        "say); it may start as rank 0 of 1."
    )


def _judge_mpich_under_pmix(
    launch: _Launch, lib: _Library, env: Mapping[str, str]
) -> tuple[Verdict, str]:
    """An MPICH-family library under a launcher that offers only PMIx."""
    if lib.pmix:
        return "ok", f"{launch.name} offers PMIx, and {lib.name} was built with PMIx."
    if lib.vendor == "Intel MPI" and env.get("I_MPI_PMI_LIBRARY"):
        return "ok", (
            f"{launch.name} offers PMIx, and I_MPI_PMI_LIBRARY points {lib.name} at a "
            f"PMI library ({env['I_MPI_PMI_LIBRARY']})."
        )
    if lib.vendor == "Intel MPI" and launch.kind == "srun":
        year = lib.major
        return ("ok" if year is not None and year >= 2021 else "doubtful"), (
            f"{launch.name} offers PMIx; Intel MPI 2021 and later find Slurm's PMIx library "
            f"by themselves (I_MPI_PMI_LIBRARY can name it for {lib.name})."
        )
    built = (
        "does not use PMIx unless I_MPI_PMI_LIBRARY names a PMIx library"
        if lib.vendor == "Intel MPI"
        else "was not built with PMIx"
    )
    return "mismatch", (
        f"{lib.name} speaks {_PMI12} and {built}, but {launch.name} offers "
        'only PMIx: MPI_Init would abort ("unsupported PMI version PMIx", "PMI_Init '
        'returned -1") or every process would start as rank 0 of 1 and train alone.'
    )


def _bin_kind(directory: Path) -> str:
    """Which MPI's launcher lives in this bin directory: "openmpi4", "openmpi", "mpich", ""."""
    if not (directory / "mpiexec").exists():
        return ""
    if (directory / "prterun").exists() or (directory / "prte").exists():
        return "openmpi"
    if (directory / "orterun").exists():
        return "openmpi4"
    if (directory / "hydra_pmi_proxy").exists() or (directory / "mpiexec.hydra").exists():
        return "mpich"
    return ""


def _loaded_libmpi() -> Path | None:
    """The libmpi this process has loaded (Linux only; ``None`` elsewhere or when none)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and re.search(r"/lib(mpi|impi|mpich)\b[^/]*\.so", parts[5]):
            return Path(parts[5].strip())
    return None


def _matching_mpiexec(lib: _Library) -> str | None:
    """The path of an mpiexec that matches ``lib``: beside this Python, or beside its libmpi."""
    wanted = {"openmpi": "openmpi", "mpich": "mpich"}.get(lib.family)
    if wanted is None:
        return None
    if lib.family == "openmpi" and lib.major is not None and lib.major < 5:
        wanted = "openmpi4"
    candidates = [Path(sys.executable).parent]
    libmpi = _loaded_libmpi()
    if libmpi is not None:
        candidates.append(libmpi.parent.parent / "bin")
    for directory in candidates:
        if _bin_kind(directory) == wanted:
            return str(directory / "mpiexec")
    return None


def _command_hint(mpiexec: str, size: int | None) -> str:
    """The command line this process would have under ``mpiexec`` (best effort)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    if name and name != "__main__":
        program = ["-m", name.removesuffix(".__main__"), *sys.argv[1:]]
    elif sys.argv and os.path.isfile(sys.argv[0]):
        program = sys.argv
    else:
        program = ["your_script.py"]
    return shlex.join([mpiexec, "-n", str(size or "N"), sys.executable, *program])


def _launcher_libpmix(env: Mapping[str, str]) -> str:
    """The PMIx client library that belongs to the launcher, or a placeholder path."""
    for prefix in (env.get("PMIX_PREFIX"), env.get("PMIX_INSTALL_PREFIX"), env.get("OPAL_PREFIX")):
        if prefix:
            for name in ("lib/openmpi/libpmix.so.2", "lib/libpmix.so.2", "lib/libpmix.so"):
                if (Path(prefix) / name).exists():
                    return str(Path(prefix) / name)
    return "/path/to/libpmix.so"


def _fixes(launch: _Launch, lib: _Library, env: Mapping[str, str], skip: str) -> tuple[str, ...]:
    """What to do, most direct first; the bypass variable always comes last."""
    ways: list[str] = []
    if launch.kind == "srun":
        plugin = "pmix" if lib.family == "openmpi" else "pmi2"
        ways.append(
            f"Launch with `srun --mpi={plugin}`, the Slurm plugin that {lib.name} speaks "
            "(`srun --mpi=list` shows the plugins your Slurm has), or set "
            f"`SLURM_MPI_TYPE={plugin}` for every srun of the job."
        )
    else:
        mpiexec = _matching_mpiexec(lib)
        if mpiexec is not None:
            which = (
                "an MPICH (hydra) mpiexec, which speaks PMI-1/2 like"
                if lib.family == "mpich"
                else "the mpiexec that belongs to"
            )
            ways.append(
                f"Launch with {which} {lib.name}, the MPI library mpi4py "
                f"loaded: `{_command_hint(mpiexec, launch.world_size)}`."
            )
        elif lib.family != "unknown":
            ways.append(
                f"Launch with the `mpiexec` (or `mpirun`) that comes with {lib.name}, the MPI "
                "library mpi4py loaded."
            )
    prefix = env.get("OPAL_PREFIX") if launch.kind == "openmpi" else None
    libdir = env.get("OMPI_LIBDIR_LOC") or (f"{prefix}/lib" if prefix else None)
    if libdir:
        mpicc = f"{prefix}/bin/mpicc" if prefix else "mpicc"
        ways.append(
            "Make mpi4py load the Open MPI library of this launcher, "
            f"`MPI4PY_LIBMPI={libdir}` (the folder that holds its libmpi), and rebuild mpi4jax "
            "against it: "
            f"`MPI4JAX_BUILD_MPICC={mpicc} pip install --no-cache-dir --force-reinstall "
            "mpi4jax`."
        )
    else:
        ways.append(
            "Make mpi4py and mpi4jax use the MPI library this launcher belongs to: "
            "`MPI4PY_LIBMPI=/path/to/its/lib` (the folder that holds its libmpi; or "
            "`pip install --no-binary=mpi4py "
            "--no-cache-dir mpi4py` with its mpicc on PATH), then "
            '`MPI4JAX_BUILD_MPICC="$(which mpicc)" pip install --no-cache-dir mpi4jax`.'
        )
    if lib.vendor == "Intel MPI" and launch.pmix and not launch.pmi12:
        pmix = _launcher_libpmix(env)
        ways.append(f"Point Intel MPI at this launcher's PMIx library: `I_MPI_PMI_LIBRARY={pmix}`.")
    elif lib.family == "mpich" and launch.pmix and not launch.pmi12:
        ways.append(f"Use an {lib.vendor} built with PMIx support (`--with-pmix`).")
    level = "all" if skip == "all" else "1"
    return (
        ways[0],
        *(f"Or {way[0].lower()}{way[1:]}" for way in ways[1:]),
        (
            f"If you know this combination works (a custom MPI build, say), set "
            f"`{SKIP_VARIABLE}={level}` to skip this check."
        ),
    )


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
      >>> report.launcher, report.pmi, report.library_name, report.world_size, report.verdict
      ('MPICH mpiexec (hydra)', 'PMI-1/2', 'MPICH 5.0.2', 2, 'ok')
      >>> openmpi = {"PRTE_LAUNCHED": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "0"}
      >>> report = jaxddp.check_launcher(openmpi, "MPICH Version: 5.0.2\\n", force=True)
      >>> report.pmi, report.verdict
      ('PMIx', 'mismatch')
      >>> try:
      ...     jaxddp.check_launcher(openmpi, "MPICH Version: 5.0.2\\n")
      ... except jaxddp.LauncherMismatchError as e:
      ...     print(str(e).splitlines()[0])
      jaxddp: the launcher does not match the MPI library; refusing to start MPI.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if library is None:
        from . import _comm  # late: _comm imports this module

        library = str(_comm.mpi().Get_library_version())
    report = _report(env, library)
    if not force:
        _act(report, stacklevel=3)
    return report


def _report(env: Mapping[str, str], library: str) -> LauncherReport:
    launch = _detect_launcher(env)
    lib = _parse_library(library)
    verdict, reason = _judge(launch, lib, env)
    fixes = _fixes(launch, lib, env, "") if verdict != "ok" else ()
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
        fixes=fixes,
        evidence=_evidence(env),
    )


def _act(report: LauncherReport, stacklevel: int) -> None:
    if report.verdict == "mismatch":
        raise LauncherMismatchError(report.message())
    if report.verdict == "doubtful":
        warnings.warn(report.message(), LauncherWarning, stacklevel=stacklevel)


# ------------------------------------------------------------ the guard and safety net

_cached: LauncherReport | None = None
_doctor_deferred = False


def _doctor_is_importing() -> bool:
    """True while ``jaxddp doctor`` or ``python -m jaxddp doctor`` imports jaxddp.

    The doctor runs the check itself and reports a mismatch instead of dying of it; the
    guard still runs before ``MPI_Init`` (from :func:`jaxddp._comm.init`).
    """
    argv = sys.argv
    if len(argv) < 2 or argv[1] != "doctor":
        return False
    return argv[0] == "-m" or os.path.basename(argv[0]) in ("jaxddp", "jaxddp.exe")


def guard(MPI: ModuleType) -> None:
    """Checks the launcher against the loaded MPI library before ``MPI_Init``.

    Runs at ``import jaxddp`` and again right before jaxddp initializes MPI. The first call
    reads the environment and the library string; later calls reuse that verdict (a
    mismatch is raised again, a warning is not repeated). ``JAXDDP_SKIP_LAUNCHER_CHECK=1``
    skips it; when MPI is already initialized, :func:`check_world_size` judges instead.
    """
    global _cached, _doctor_deferred
    if _cached is None and not _doctor_deferred and _doctor_is_importing():
        _doctor_deferred = True  # only the import-time call: the doctor checks by itself
        return
    if _cached is not None:
        if _cached.verdict == "mismatch" and not _skip_level(os.environ):
            raise LauncherMismatchError(_cached.message())
        return
    if _skip_level(os.environ) or MPI.Is_initialized():
        return
    _cached = _report(os.environ, str(MPI.Get_library_version()))
    _act(_cached, stacklevel=3)


def check_world_size(size: int, environ: Mapping[str, str] | None = None) -> None:
    """After ``MPI_Init``: refuses a world of 1 when the launcher announced more.

    This is the safety net for what :func:`guard` could not foresee (or was told to skip):
    N processes that each believe they are rank 0 of 1 would train N separate models.
    ``JAXDDP_SKIP_LAUNCHER_CHECK=all`` turns it off.

    Example:
      >>> from jaxddp import _launcher
      >>> _launcher.check_world_size(1, {})  # no launcher: a world of 1 is right
      >>> try:
      ...     _launcher.check_world_size(1, {"HYDI_CONTROL_FD": "7", "PMI_SIZE": "2"})
      ... except _launcher.LauncherMismatchError as e:
      ...     print(str(e).splitlines()[0])
      jaxddp: MPI started this process as rank 0 of 1, but the launcher started 2 processes.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if size != 1 or _skip_level(env) == "all":
        return
    launch = _detect_launcher(env)
    if launch.world_size is None or launch.world_size <= 1:
        return
    library = _cached_library_text()
    lib = _parse_library(library) if library else _Library("unknown", "unknown", "", False)
    fixes = _fixes(launch, lib, env, "all")
    n = launch.world_size
    table = (
        f"launcher:    {launch.name}\n"
        f"PMI offered: {launch.offers}\n"
        f"MPI library: {lib.name} (speaks {lib.speaks})\n"
        f"world size:  {n} according to the launcher ({launch.world_size_source}), 1 "
        "according to MPI"
    )
    reason = (
        "Each process is a silent singleton: the MPI library did not connect to the "
        f"launcher, so {n} copies would each train alone."
    )
    head = (
        f"jaxddp: MPI started this process as rank 0 of 1, but the launcher started {n} processes."
    )
    raise LauncherMismatchError(_compose(head, table, reason, fixes))


def _cached_library_text() -> str:
    if "mpi4py.MPI" not in sys.modules:
        return ""
    try:
        return str(sys.modules["mpi4py.MPI"].Get_library_version())
    except Exception:  # noqa: BLE001 - only for a message
        return ""
