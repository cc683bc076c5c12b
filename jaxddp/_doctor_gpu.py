"""What ``jaxddp doctor`` says about GPUs and about how mpi4jax was built (jaxddp/_cli.py).

Per rank: the GPU it was given (:mod:`jaxddp._runtime.gpus`), whether its JAX preallocates
GPU memory, and the MPI and CUDA runtime libraries loaded in the process; for the job: which
handlers collectives in GPU programs run (:func:`jaxddp._native.gpu_status`) and whether
mpi4jax has its CUDA extension. And the one command that builds mpi4jax against the MPI
library mpi4py loaded (:func:`mpi4jax_build_command`), which the doctor's fixes name.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from . import _native
from ._base import cuda as _cuda
from ._runtime import gpus as _gpus
from ._runtime import launcher as _launcher

__all__ = ["GpuFacts", "facts", "lines", "mpi4jax_build_command", "problems"]


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    """One rank's GPU findings; rank 0 gathers them."""

    rank: int
    jax_cuda: str | None  # the JAX CUDA plugin installed (None: JAX computes on CPUs)
    gpu: str  # the GPU this rank was given, as gpus.Assignment.describe() says
    bus: str | None  # its PCI bus id
    sharing: tuple[int, ...]  # the ranks of its node on the same GPU
    preallocate: str  # how its JAX takes GPU memory
    fraction: float | None  # the share of the GPU's memory it preallocates (None: none)
    libraries: tuple[str, ...]  # the MPI and CUDA runtime libraries loaded in the process
    mpi4jax_cuda: bool | None  # whether mpi4jax's CUDA extension imports (None: unknown)


def _loaded(pattern: str) -> list[str]:
    """The files loaded in this process whose names match ``pattern`` (Linux only)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = []
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and re.search(pattern, Path(parts[5].strip()).name):
            path = parts[5].strip()
            if path not in found:
                found.append(path)
    return found


def _memory() -> str:
    settings = [f"{v}={os.environ[v]}" for v in _gpus.MEMORY_VARIABLES if os.environ.get(v)]
    return ", ".join(settings) or "JAX's default (preallocates 75% of the GPU's memory)"


def _fraction() -> float | None:
    """The share of its GPU's memory this rank's JAX takes at start (None: it grows)."""
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip().lower() in ("false", "0"):
        return None
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or 0.75)
    except ValueError:
        return 0.75


def facts(rank: int) -> GpuFacts:
    """This rank's GPU findings (after jaxddp's world started)."""
    mpi4jax_cuda = None
    if "mpi4jax" in sys.modules:
        from ._collectives._jax import compat

        mpi4jax_cuda = compat.mpi4jax_has_cuda()
    done = _gpus.assignment()
    return GpuFacts(
        rank=rank,
        jax_cuda=_cuda.jax_may_use_cuda(),
        gpu=done.describe(),
        bus=done.seen[done.ordinal] if done.ordinal is not None else None,
        sharing=done.sharing,
        preallocate=_memory(),
        fraction=_fraction(),
        libraries=tuple(_loaded(r"^lib(mpi|mpich|impi)\b.*\.so") + _loaded(r"^libcudart\b")),
        mpi4jax_cuda=mpi4jax_cuda,
    )


def lines(rows: Sequence[GpuFacts]) -> list[str]:
    """The doctor's lines about GPUs (none where no rank's JAX can use one)."""
    if not any(r.jax_cuda for r in rows):
        return []
    wrap = _launcher.wrap
    out = ["", "GPUs:", *wrap(f"collectives: {_native.gpu_status()}", "  ", " " * 15)]
    for r in rows:
        memory = "" if r.preallocate in r.gpu else f"; memory: {r.preallocate}"
        out += wrap(f"rank {r.rank}: {r.gpu}{memory}", "  ", "    ")
    first = rows[0]
    if first.mpi4jax_cuda is not None:
        has = "has" if first.mpi4jax_cuda else "has no"
        out += wrap(
            f"mpi4jax {has} its CUDA extension (needed only without jaxddp's)", "  ", "    "
        )
    if first.libraries:
        out += wrap(f"loaded (rank 0): {', '.join(first.libraries)}", "  ", "    ")
    return out


def problems(rows: Sequence[GpuFacts]) -> list[str]:
    """What will fail on the GPUs, each with its fix."""
    found = []
    rows_by_rank = {r.rank: r for r in rows}
    for r in rows:
        mpis = [p for p in r.libraries if not Path(p).name.startswith("libcudart")]
        if len({Path(p).name.split(".so")[0] + str(Path(p).parent) for p in mpis}) > 1:
            found.append(
                f"rank {r.rank} has two MPI libraries loaded ({', '.join(mpis)}): mpi4jax was "
                f"built against another MPI than mpi4py loads. Rebuild it: "
                f"`{mpi4jax_build_command()}`."
            )
        taken = sum((rows_by_rank.get(s) or r).fraction or 0.0 for s in r.sharing)
        if len(r.sharing) > 1 and r.rank == min(r.sharing) and taken > 0.95:
            found.append(
                f"ranks {', '.join(map(str, r.sharing))} share the GPU {r.bus} and their JAX "
                f"preallocates {taken:.0%} of its memory in all: one runs out of memory. Set "
                "`XLA_PYTHON_CLIENT_PREALLOCATE=false` for every rank, or "
                f"`XLA_PYTHON_CLIENT_MEM_FRACTION={0.9 / len(r.sharing):.2f}`."
            )
    first = rows[0] if rows else None
    if (
        first
        and first.jax_cuda
        and _native.gpu_target("allreduce") is None
        and not first.mpi4jax_cuda
    ):
        found.append(
            "JAX computes on GPUs here, but jaxddp's GPU handlers are not in use "
            f"({_native.gpu_status()}) and mpi4jax has no CUDA extension: a jitted step "
            "holding a collective cannot compile. Turn JAXDDP_NATIVE_ALLREDUCE on (with a C++ "
            "compiler, `CXX`), or build mpi4jax with CUDA (`CUDA_ROOT` set): "
            f"`{mpi4jax_build_command()}`."
        )
    return found


def mpi4jax_build_command() -> str:
    """The command that builds mpi4jax against the MPI library this process loaded, whose
    folders come first in the link: a Python whose own library folder holds another MPI's
    ``libmpi.so`` (Ubuntu's, beside a system Open MPI) otherwise links that one, as
    setuptools passes that folder before the compiler wrapper's own."""
    libmpi = _launcher.loaded_libmpi()
    if libmpi is None:
        return 'MPI4JAX_BUILD_MPICC="$(which mpicc)" pip install --no-cache-dir mpi4jax'
    libdir = libmpi.parent
    prefix = libdir.parent
    mpicc = prefix / "bin" / "mpicc"
    wrapper = shlex.quote(str(mpicc)) if mpicc.exists() else '"$(which mpicc)"'
    include = prefix / "include"
    flags = [f"-L{libdir}", f"-Wl,-rpath,{libdir}"]
    env = [f"LDFLAGS={shlex.quote(' '.join(flags))}"]
    if include.is_dir():
        env.append(f"CPPFLAGS=-I{shlex.quote(str(include))}")
    return (
        "pip install setuptools wheel nanobind && "
        f"{' '.join(env)} MPI4JAX_BUILD_MPICC={wrapper} pip install --no-build-isolation "
        "--no-cache-dir --force-reinstall --no-deps mpi4jax"
    )
