"""jaxddp's collectives in programs compiled for a GPU (``staged.cc``): set up where JAX may
use CUDA, registered for the CUDA platform under :func:`target`.

MPI libraries read host memory; few are built to read GPU memory (CUDA-aware), and the
``mpich`` wheel is not. So each call copies its buffer, on XLA's stream, into pinned host
memory, reduces it there as a CPU call would (the node's shared memory, else MPI) and
copies the result back, in chunks that overlap the copies with the reduction. Where the MPI
library says it is CUDA-aware (``MPIX_Query_cuda_support``) and every rank's does,
``JAXDDP_CUDA_AWARE_MPI`` (on by default) lets MPI take the GPU buffers themselves.

The test suite runs the same handlers on the CPU (:data:`on_cpu`), against a stand-in for the
CUDA driver (:data:`jaxddp._base.cuda.stand_in`): switches it sets from its own environment
variables (``tests/harness/switches.py``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import jax

from .._base import cuda as _cuda
from .._base import settings as _settings
from .kinds import KINDS as _TABLE
from .kinds import Kind

__all__ = [
    "DRIVER_FUNCTIONS",
    "KINDS",
    "attributes",
    "disagreement",
    "load",
    "on_cpu",
    "target",
]

# one staged handler per kind of the table (kinds.py) but the CPU's own (``staged=False``)
KINDS = tuple(kind for kind, row in _TABLE.items() if row.staged)
_STAGED = {kind: _TABLE[kind] for kind in KINDS}
DRIVER_FUNCTIONS = (
    "cuStreamGetCtx", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuMemcpyAsync",
    "cuStreamSynchronize", "cuMemHostAlloc", "cuMemFreeHost", "cuGetErrorName",
)  # fmt: skip
# The test suite's switch: programs compiled for the CPU use the staged handlers too (their
# host side, with the stand-in driver), so that the whole MPI suite can run them; False
# (always, for a user): only programs for a GPU do.
on_cpu = False


def target(kind: str) -> str:
    """The FFI target of the staged handler of a collective kind."""
    return f"jaxddp_staged_{kind}"


def forced_on_cpu() -> bool:
    """Whether the test suite asked for the staged handlers in programs compiled for CPU."""
    return on_cpu


def attributes(library: ctypes.CDLL, kind: str) -> list[str]:
    """The attribute names the staged handler of ``kind`` takes, as its binding declares."""
    function = library.jaxddp_native_staged_attributes
    function.argtypes = [ctypes.c_char_p]
    function.restype = ctypes.c_char_p
    return (function(kind.encode()) or b"").decode().split(",")


def disagreement(
    library: ctypes.CDLL, rows: dict[str, Kind] = _STAGED, unknown: Sequence[str] = ()
) -> str | None:
    """Where the handlers of ``library`` (``staged.cc``) and the table's ``rows`` disagree
    on a kind's attributes, or a kind's MPI function is among those the build did not take
    (``unknown``: ``native.h``'s list lacks it): why, naming the kind; None where they agree."""
    for kind, row in rows.items():
        if row.mpi_function in unknown:
            return f"its build does not take {row.mpi_function}, which its {kind} handler calls"
        bound = attributes(library, kind)
        if sorted(bound) != sorted(row.handler_attributes()):
            return (
                f"its {kind} handler takes the attributes {','.join(bound) or '(none)'}, where "
                f"jaxddp/_native/kinds.py says {','.join(row.handler_attributes())}"
            )
    return None


def _cuda_aware(MPI: Any) -> bool:
    """Whether the MPI library mpi4py loaded says it takes GPU buffers."""
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (AttributeError, OSError):
        return False
    query.restype = ctypes.c_int
    query.argtypes = []
    return bool(query())


def _driver(library: ctypes.CDLL) -> str | None:
    """Hands ``library`` the CUDA driver's entry points: None, or why it could not."""
    try:
        configure = library.jaxddp_native_staged_driver
        configure.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
        configure.restype = ctypes.c_int64
        for name in DRIVER_FUNCTIONS:
            if not configure(name.encode(), _cuda.address(name)):
                return f"its build does not take the driver's {name}"
    except _cuda.CudaError as error:
        return str(error)
    return None


def load(library: ctypes.CDLL, MPI: Any, unknown: Sequence[str] = ()) -> tuple[str | None, bool]:
    """Configures and registers the staged handlers of ``library`` where JAX may use CUDA
    (or the test suite forces them on the CPU): None, or why not; and whether this rank's
    MPI takes GPU buffers (and ``JAXDDP_CUDA_AWARE_MPI`` allows it). ``unknown``: the MPI
    functions the library's build did not take (``native.h``'s list lacks them)."""
    if _cuda.jax_may_use_cuda() is None and not forced_on_cpu():
        return "JAX has no CUDA plugin here (or JAX_PLATFORMS leaves CUDA out)", False
    problem = _driver(library) or disagreement(library, _STAGED, unknown)
    if problem is not None:
        return problem, False
    aware = _settings.cuda_aware_mpi() and _cuda_aware(MPI)
    ready = library.jaxddp_native_staged_ready
    ready.argtypes = [ctypes.c_int64]
    ready.restype = ctypes.c_int64
    if not ready(int(aware)):
        return "the MPI library lacks a nonblocking collective the handlers call", False
    try:
        for kind in KINDS:
            for platform in ("CUDA", *(["cpu"] if forced_on_cpu() else [])):
                host = "host_" if platform == "cpu" else ""
                capsule = jax.ffi.pycapsule(getattr(library, f"jaxddp_staged_{host}{kind}"))
                jax.ffi.register_ffi_target(target(kind), capsule, platform=platform)
    except (AttributeError, RuntimeError, ValueError) as error:
        return f"they could not be registered with JAX: {error}", False
    return None, aware
