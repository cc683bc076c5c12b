"""jaxddp's own XLA FFI handler for the jitted allreduce (``allreduce.cc``), built on first use.

Why: MPICH's blocking wait, under ``MPI_THREAD_MULTIPLE`` (what jaxddp starts MPI with),
calls ``sched_yield`` between polls. Inside a jitted step the allreduce runs on XLA's compute
thread while the Python thread goes on with the framework's work; with one core per rank the
two share it, and each yield hands the core to Python for a whole time slice (~3-4 ms on
Linux), once per step of the collective's protocol (``benchmarks/bench_core_sharing.py``:
0.42 MB, 0.18 ms on an idle core, 16 ms beside a busy thread). The handler posts
``MPI_Iallreduce`` and waits with ``MPI_Test``, which never yields: it polls while the
collective is young, then naps (``nanosleep``, growing), so the core goes to Python while
the other ranks are away and comes back to the collective when a nap ends (a thread that
slept runs ahead of one that has been running).

How: compiled with the C++ compiler (``$CXX``, else ``c++``) against the FFI headers of the
jaxlib in use (``jax.ffi.include_dir()``), into ``$XDG_CACHE_HOME/jaxddp/native`` (else
``~/.cache/...``), once per source, jaxlib and compiler; a lock file makes the ranks of a
node build it once. It includes no MPI header: the two MPI functions it calls come from the
library mpi4py loaded, and handles travel as 64-bit integers (MPICH's ints, Open MPI's
pointers), so one build serves either MPI.

A nonblocking collective never matches a blocking one, so every rank must use the same
handler: :func:`agree` (collective, when jaxddp's world starts) picks jaxddp's only where
every rank could load it and none turned it off (``JAXDDP_NATIVE_ALLREDUCE``), else mpi4jax's
everywhere; :func:`status` says which and why (``jaxddp doctor`` prints it). It is registered
for CPU only, and used where a program is lowered for CPU alone (``_lowering.emit``); choosing
it touches no JAX backend, so ``jaxddp.init()`` still comes before any JAX configuration.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

from .. import _settings

__all__ = ["TARGET", "agree", "allreduce_target", "status"]

TARGET = "jaxddp_allreduce"
_SOURCE = Path(__file__).with_name("allreduce.cc")
_OURS = (
    "jaxddp's own on CPU (MPI_Iallreduce, then MPI_Test: polls, then naps); mpi4jax's on "
    "other platforms"
)

# What every rank agreed on (agree): the FFI target, or None for mpi4jax's; and why.
_agreed: tuple[str | None, str] | None = None


def cache_dir() -> Path:
    """Where the built handler is kept."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxddp" / "native"


def _compiler() -> list[str]:
    command = shlex.split(os.environ.get("CXX", "")) or ["c++"]
    if shutil.which(command[0]) is None:
        msg = f"no C++ compiler: {command[0]!r} is not on PATH (set CXX to one)"
        raise RuntimeError(msg)
    return command


def _build() -> Path:
    """The handler's shared library for this jaxlib and compiler: from the cache, or built."""
    include = jax.ffi.include_dir()
    flags = [*_compiler(), "-std=c++17", "-O2", "-shared", "-fPIC", "-isystem", include]
    identity = [_SOURCE.read_text(), metadata.version("jaxlib"), *flags]
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:16]
    folder = cache_dir()
    library = folder / f"allreduce-{key}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"allreduce-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds; the others wait, then load it
        if library.exists():
            return library
        scratch = folder / f"allreduce-{key}.{os.getpid()}.so"
        command = [*flags, str(_SOURCE), "-o", str(scratch)]
        out = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
        if out.returncode != 0:
            scratch.unlink(missing_ok=True)
            msg = f"`{shlex.join(command)}` failed:\n{out.stderr[-2000:]}"
            raise RuntimeError(msg)
        scratch.replace(library)  # whole or absent, for a process that looks meanwhile
    return library


def _mpi_function(mpi4py_extension: ctypes.CDLL, name: str) -> int:
    # dlsym on the extension's handle searches the libraries it links: the MPI mpi4py uses
    address = ctypes.cast(getattr(mpi4py_extension, name), ctypes.c_void_p).value
    if not address:
        msg = f"{name} is not in the MPI library mpi4py loaded"
        raise RuntimeError(msg)
    return address


def _load(MPI: Any) -> str | None:
    """Builds (or finds), loads and registers the handler here; None, or why not."""
    if not _settings.native_allreduce():
        return f"{_settings.NATIVE_ALLREDUCE.name} is off"
    try:
        library = ctypes.CDLL(str(_build()))
        library.jaxddp_native_configure.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        mpi = ctypes.CDLL(MPI.__file__)
        library.jaxddp_native_configure(
            _mpi_function(mpi, "MPI_Iallreduce"), _mpi_function(mpi, "MPI_Test")
        )
        capsule = jax.ffi.pycapsule(library.jaxddp_allreduce)
        jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
    except (AttributeError, OSError, RuntimeError, subprocess.SubprocessError) as error:
        return f"it could not be built or loaded here: {error}"
    return None


def agree(MPI: Any, comm: Any) -> None:
    """Collective over ``comm`` (every rank of the world): picks the handler every rank
    uses, jaxddp's only where every rank loaded it."""
    global _agreed
    if _agreed is not None:
        return
    problem = _load(MPI)
    ready = comm.allreduce(problem is None, op=MPI.LAND)
    if ready:
        _agreed = (TARGET, _OURS)
    elif problem is not None:
        _agreed = (None, f"mpi4jax's: {problem}")
    else:
        _agreed = (None, "mpi4jax's: another rank could not use jaxddp's (see its doctor)")


def allreduce_target() -> str | None:
    """The FFI target of jaxddp's allreduce where every rank agreed on it, else None."""
    return _agreed[0] if _agreed is not None else None


def status() -> str:
    """Which handler jitted allreduces use, and why."""
    return _agreed[1] if _agreed is not None else "not chosen yet (jaxddp's world not started)"
