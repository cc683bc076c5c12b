"""What the user should do about a mismatch, most direct first; the bypass always last."""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from ..._base.settings import SKIP_LAUNCHER_CHECK, SkipLevel
from .kinds import Kind, Launch
from .library import Family, Library

__all__ = ["fixes", "loaded_libmpi", "matching_mpiexec"]


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


def loaded_libmpi() -> Path | None:
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


def matching_mpiexec(lib: Library) -> str | None:
    """The path of an mpiexec that matches ``lib``: beside this Python, or beside its libmpi."""
    wanted = {Family.OPENMPI: "openmpi", Family.MPICH: "mpich"}.get(lib.family)
    if wanted is None:
        return None
    if lib.family is Family.OPENMPI and lib.major is not None and lib.major < 5:
        wanted = "openmpi4"
    candidates = [Path(sys.executable).parent]
    libmpi = loaded_libmpi()
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


def _launch_with(launch: Launch, lib: Library) -> str | None:
    """The fix that changes the launcher: the srun plugin, or the library's own mpiexec."""
    if launch.kind is Kind.SRUN:
        plugin = "pmix" if lib.family is Family.OPENMPI else "pmi2"
        return (
            f"Launch with `srun --mpi={plugin}`, the Slurm plugin that {lib.name} speaks "
            "(`srun --mpi=list` shows the plugins your Slurm has), or set "
            f"`SLURM_MPI_TYPE={plugin}` for every srun of the job."
        )
    mpiexec = matching_mpiexec(lib)
    if mpiexec is not None:
        which = (
            "an MPICH (hydra) mpiexec, which speaks PMI-1/2 like"
            if lib.family is Family.MPICH
            else "the mpiexec that belongs to"
        )
        return (
            f"Launch with {which} {lib.name}, the MPI library mpi4py "
            f"loaded: `{_command_hint(mpiexec, launch.world_size)}`."
        )
    if lib.family is not Family.UNKNOWN:
        return (
            f"Launch with the `mpiexec` (or `mpirun`) that comes with {lib.name}, the MPI "
            "library mpi4py loaded."
        )
    return None


def _use_the_launchers_library(launch: Launch, env: Mapping[str, str]) -> str:
    """The fix that changes the library: make mpi4py and mpi4jax load the launcher's."""
    prefix = env.get("OPAL_PREFIX") if launch.kind.is_openmpi else None
    libdir = env.get("OMPI_LIBDIR_LOC") or (f"{prefix}/lib" if prefix else None)
    if libdir:
        mpicc = f"{prefix}/bin/mpicc" if prefix else "mpicc"
        return (
            "Make mpi4py load the Open MPI library of this launcher, "
            f"`MPI4PY_LIBMPI={libdir}` (the folder that holds its libmpi), and rebuild mpi4jax "
            "against it: "
            f"`MPI4JAX_BUILD_MPICC={mpicc} pip install --no-cache-dir --force-reinstall "
            "mpi4jax`."
        )
    return (
        "Make mpi4py and mpi4jax use the MPI library this launcher belongs to: "
        "`MPI4PY_LIBMPI=/path/to/its/lib` (the folder that holds its libmpi; or "
        "`pip install --no-binary=mpi4py "
        "--no-cache-dir mpi4py` with its mpicc on PATH), then "
        '`MPI4JAX_BUILD_MPICC="$(which mpicc)" pip install --no-cache-dir mpi4jax`.'
    )


def fixes(launch: Launch, lib: Library, env: Mapping[str, str], skip: SkipLevel) -> tuple[str, ...]:
    """What to do, most direct first; the bypass (at level ``skip``) always comes last."""
    ways: list[str] = []
    first = _launch_with(launch, lib)
    if first is not None:
        ways.append(first)
    ways.append(_use_the_launchers_library(launch, env))
    if lib.vendor == "Intel MPI" and launch.pmix and not launch.pmi12:
        pmix = _launcher_libpmix(env)
        ways.append(f"Point Intel MPI at this launcher's PMIx library: `I_MPI_PMI_LIBRARY={pmix}`.")
    elif lib.family is Family.MPICH and launch.pmix and not launch.pmi12:
        ways.append(f"Use an {lib.vendor} built with PMIx support (`--with-pmix`).")
    level = "all" if skip is SkipLevel.ALL else "1"
    return (
        ways[0],
        *(f"Or {way[0].lower()}{way[1:]}" for way in ways[1:]),
        (
            f"If you know this combination works (a custom MPI build, say), set "
            f"`{SKIP_LAUNCHER_CHECK.name}={level}` to skip this check."
        ),
    )
