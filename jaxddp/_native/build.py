"""Builds jaxddp's handler library (``allreduce.cc``, ``staged.cc``) on first use, once per
source, jaxlib and compiler, into a cache that the ranks of a node share.

Compiled with the C++ compiler (``$CXX``, else ``c++``) against the FFI headers of the jaxlib
in use (``jax.ffi.include_dir()``), into ``$XDG_CACHE_HOME/jaxddp/native`` (else
``~/.cache/...``); a lock file makes the ranks of a node build it once. It includes no MPI
and no CUDA header and links neither: their entry points are handed over at run time, so one
build serves either MPI, with or without a GPU.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import jax

__all__ = ["build", "cache_dir"]

_FOLDER = Path(__file__).parent
SOURCES = (_FOLDER / "allreduce.cc", _FOLDER / "staged.cc", _FOLDER / "narrow.cc")
HEADERS = (_FOLDER / "native.h",)


def cache_dir() -> Path:
    """Where the built library is kept."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxddp" / "native"


def _compiler() -> list[str]:
    command = shlex.split(os.environ.get("CXX", "")) or ["c++"]
    if shutil.which(command[0]) is None:
        msg = f"no C++ compiler: {command[0]!r} is not on PATH (set CXX to one)"
        raise RuntimeError(msg)
    return command


def build() -> Path:
    """The library for this jaxlib and compiler: from the cache, or built."""
    include = jax.ffi.include_dir()
    # -ffp-contract=off: each product rounded before a sum, as XLA's compositions of the same
    # arithmetic compute it (narrow.cc gives their bits; a fused multiply-add would not)
    flags = [*_compiler(), "-std=c++17", "-O3", "-ffp-contract=off", "-shared", "-fPIC"]
    flags += ["-isystem", include]
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    identity = [*texts, metadata.version("jaxlib"), *flags]
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
        command = [*flags, "-I", str(_FOLDER), *map(str, SOURCES), "-o", str(scratch)]
        out = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
        if out.returncode != 0:
            scratch.unlink(missing_ok=True)
            msg = f"`{shlex.join(command)}` failed:\n{out.stderr[-2000:]}"
            raise RuntimeError(msg)
        scratch.replace(library)  # whole or absent, for a process that looks meanwhile
    return library
