"""jaxddp's own XLA FFI handlers: the jitted allreduce on CPU (``allreduce.cc``), gradient
compression's narrow allreduce on CPU (``narrow.cc``), and every collective in programs
compiled for a GPU (``staged.cc``, :mod:`.staged`), built on first use (:mod:`.build`).

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

Where every rank is on this node (2 to :data:`MAX_SHARED_RANKS` of them; :func:`share`,
collective, when jaxddp's world starts), sums, maxima and minima skip MPI: each rank copies
its part into its own slot of an MPI shared-memory window, spins 50 µs, then sleeps on a
futex until the last rank has copied (that rank rings once: one wake-up a call), and reduces
every rank's slot in rank order, so every rank holds the same bits. A message larger than a
slot goes through in turns. Where the ranks' calls at one point are all of this kind but
differ (count, dtype or op as sent, or the call as its caller made it: the op asked for, mean
included, and every leaf's dtype and shape, a description the lowering attaches to each call;
a call of no element takes part too), each rank gets an error naming both calls instead of a
wrong sum; where one rank's call goes through MPI instead, they wait for each other as mismatched
MPI calls do (jaxddp's signature check, ``JAXDDP_CHECK``, catches both before). The wait
has no timeout, as a blocking collective has none: a rank that never comes is the stall
inspector's to report. Whether a call goes this way depends only on its attributes
(communicator, op, datatype), so every rank decides the same; other ops and datatypes go
through MPI as above.

How: :mod:`.build` compiles it once per source, jaxlib and compiler. It includes no MPI
header: the MPI functions it calls come from the library mpi4py loaded, and handles travel as
64-bit integers (MPICH's ints, Open MPI's pointers), so one build serves either MPI.

A nonblocking collective never matches a blocking one, so every rank must use the same
handler: :func:`agree` (collective, when jaxddp's world starts) picks jaxddp's only where
every rank could load it (``JAXDDP_NATIVE_ALLREDUCE`` is the same on every rank:
``jaxddp._runtime.agreement`` refuses a job where it differs), else mpi4jax's everywhere; :func:`status` says which and why (``jaxddp doctor`` prints it). The CPU
handler is used where a program is lowered for CPU alone, the staged ones where it is lowered
for CUDA (``_collectives/_jax/lowering.py``), each where every rank agreed on it; choosing
touches no JAX backend, so ``jaxddp.init()`` still comes before any JAX configuration.
"""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
from typing import Any

import jax

from .._base import mpi as _mpi
from .._base import settings as _settings
from .._types import Communicator
from . import staged as _staged
from .build import build, cache_dir
from .kinds import KINDS as _TABLE

__all__ = [
    "NARROW_TARGET",
    "TARGET",
    "agree",
    "allreduce_target",
    "cache_dir",
    "cpu_staged",
    "cpu_target",
    "gpu_buffers_to_mpi",
    "gpu_status",
    "gpu_target",
    "narrow_target",
    "reduces_in_shared_memory",
    "share",
    "shared_calls",
    "shares",
    "status",
]

TARGET = "jaxddp_allreduce"
NARROW_TARGET = _TABLE["narrow_allreduce"].target
_OURS = "jaxddp's own on CPU (MPI_Iallreduce, then MPI_Test: polls, then naps)"
# The MPI functions the handlers call: the CPU's (the allreduce's, the narrow allreduce's),
# then the staged handlers' (each kind's of the table, kinds.py).
_CPU_FUNCTIONS = ("MPI_Iallreduce", "MPI_Test", "MPI_Ialltoall", "MPI_Iallgather")
_STAGED_FUNCTIONS = tuple(dict.fromkeys(row.mpi_function for row in _TABLE.values() if row.staged))

# What every rank agreed on (agree): the FFI target, or None for mpi4jax's; and why.
_agreed: tuple[str | None, str] | None = None
# And on a GPU: whether the staged handlers are in use, whether MPI takes GPU buffers, why.
_gpu: tuple[bool, bool, str] | None = None
_library: ctypes.CDLL | None = None  # the loaded handlers
# The staged handlers' MPI functions that the build's jaxddp_native_configure does not know
# (native.h's JAXDDP_MPI_FUNCTIONS lacks them): those handlers are not used (staged.load).
_unknown: list[str] = []


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
    global _library
    try:
        library = ctypes.CDLL(str(build()))
        library.jaxddp_native_configure.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
        library.jaxddp_native_configure.restype = ctypes.c_int64
        mpi = ctypes.CDLL(MPI.__file__)
        for name in _CPU_FUNCTIONS:
            if not library.jaxddp_native_configure(name.encode(), _mpi_function(mpi, name)):
                return f"its build does not take {name}"
        for name in _STAGED_FUNCTIONS:  # the staged handlers' (they refuse to run without)
            if name in _CPU_FUNCTIONS:
                continue
            with contextlib.suppress(RuntimeError):
                if not library.jaxddp_native_configure(name.encode(), _mpi_function(mpi, name)):
                    _unknown.append(name)
        capsule = jax.ffi.pycapsule(library.jaxddp_allreduce)
        jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
        capsule = jax.ffi.pycapsule(library.jaxddp_narrow_allreduce)
        jax.ffi.register_ffi_target(NARROW_TARGET, capsule, platform="cpu")
        library.jaxddp_native_share.argtypes = [
            *[ctypes.c_void_p] * 2,
            *[ctypes.c_int64] * 4,
            *[ctypes.POINTER(ctypes.c_int64)] * 3,
            ctypes.c_int64,
            ctypes.POINTER(ctypes.c_int64),
        ]
        library.jaxddp_native_share_on.argtypes = [ctypes.c_int64]
        library.jaxddp_native_shared_arrivals.argtypes = [ctypes.c_int64]
        library.jaxddp_native_shared_arrivals.restype = ctypes.c_int64
        library.jaxddp_native_header_bytes.argtypes = [ctypes.c_int64]
        library.jaxddp_native_header_bytes.restype = ctypes.c_int64
        library.jaxddp_native_kind.argtypes = [ctypes.c_char_p]
        library.jaxddp_native_kind.restype = ctypes.c_int64
        if any(library.jaxddp_native_kind(c.encode()) < 0 for c, _ in _KINDS.values()):
            return "its build does not know every dtype jaxddp sends"
        _library = library
    except (AttributeError, OSError, RuntimeError, subprocess.SubprocessError) as error:
        return f"it could not be built or loaded here: {error}"
    return None


def agree(MPI: Any, comm: Communicator) -> None:
    """Collective over ``comm`` (every rank of the world): picks the handlers every rank
    uses, jaxddp's only where every rank loaded them: on CPU, and in programs for a GPU."""
    global _agreed, _gpu
    if _agreed is not None:
        return
    problem = _load(MPI)
    gpu_problem, aware = "jaxddp's handlers are not in use here", False
    if problem is None and _library is not None:
        gpu_problem, aware = _staged.load(_library, MPI, _unknown)
    everyone = comm.allgather((problem is None, gpu_problem is None, aware))
    ready, gpu_ready, all_aware = (all(column) for column in zip(*everyone, strict=True))
    if ready:
        _agreed = (TARGET, _OURS)
    elif problem is not None:
        _agreed = (None, f"mpi4jax's: {problem}")
    else:
        _agreed = (None, "mpi4jax's: another rank could not use jaxddp's (see its doctor)")
    if gpu_ready:
        how = "GPU buffers to MPI directly (CUDA-aware MPI)" if all_aware else "host staging"
        _gpu = (True, all_aware, f"jaxddp's own, {how}")
    else:
        why = gpu_problem or "another rank could not use them (see its doctor)"
        _gpu = (False, False, f"mpi4jax's, with host staging (jaxddp's are not in use: {why})")


def allreduce_target() -> str | None:
    """The FFI target of jaxddp's allreduce where every rank agreed on it, else None."""
    return _agreed[0] if _agreed is not None else None


def narrow_target() -> str | None:
    """The FFI target of jaxddp's narrow allreduce on CPU where every rank agreed on
    jaxddp's handlers, else None (the composition of an alltoall and an allgather)."""
    return NARROW_TARGET if allreduce_target() is not None else None


def cpu_target(kind: str) -> str | None:
    """The FFI target of jaxddp's own CPU handler of ``kind`` (the table's ``native``)
    where every rank agreed on jaxddp's handlers, else None."""
    return {"allreduce": allreduce_target, "narrow_allreduce": narrow_target}[kind]()


def gpu_target(kind: str) -> str | None:
    """The FFI target of a collective ``kind`` in a program for a GPU where every rank
    agreed on jaxddp's staged handlers, else None (mpi4jax's; and for a kind that has no
    staged handler)."""
    on = _gpu is not None and _gpu[0] and kind in _staged.KINDS
    return _staged.target(kind) if on else None


def cpu_staged() -> bool:
    """Whether programs for the CPU use the staged handlers (the test suite's switch)."""
    return _staged.forced_on_cpu() and gpu_target("allreduce") is not None


def gpu_buffers_to_mpi() -> bool:
    """Whether GPU buffers go to MPI directly (every rank's MPI is CUDA-aware)."""
    return _gpu is not None and _gpu[1]


def status() -> str:
    """Which handler jitted allreduces use, and why."""
    if _agreed is None:
        return "not chosen yet (jaxddp's world not started)"
    if _shared is not None:
        return (
            f"{_agreed[1]}; the {_shared[1]} ranks, all on this node, reduce sums, maxima and "
            "minima in memory they share, without MPI"
        )
    return _agreed[1]


def reduces_in_shared_memory(target: str, comm_handle: int) -> bool:
    """Whether a call to ``target`` over the communicator with this C handle reduces sums,
    maxima and minima in the node's shared memory (which keeps a NaN as the result itself)."""
    staged_on_host = target == _staged.target("allreduce") and not gpu_buffers_to_mpi()
    return (target == TARGET or staged_on_host) and shares(comm_handle)


def gpu_status() -> str:
    """Which handlers collectives in programs for a GPU use, and why."""
    return "not chosen yet (jaxddp's world not started)" if _gpu is None else _gpu[2]


# The shared-memory allreduce (share): the largest world it serves, a slot's size, and the
# datatypes it takes (mpi4py's name, the handler's kind, how many of that kind an element
# holds): every dtype jaxddp sends as it is but bool, which jaxddp widens first.
MAX_SHARED_RANKS = 8
SLOT_BYTES = 1 << 20
# (the handler's own codes for the kinds, and the header's size, are asked of the library:
# allreduce.cc defines them once)
_KINDS = {
    "FLOAT": ("float32", 1), "DOUBLE": ("float64", 1),
    "COMPLEX": ("float32", 2), "DOUBLE_COMPLEX": ("float64", 2),
    "INT8_T": ("int8", 1), "INT16_T": ("int16", 1), "INT32_T": ("int32", 1),
    "INT64_T": ("int64", 1), "UINT8_T": ("uint8", 1), "UINT16_T": ("uint16", 1),
    "UINT32_T": ("uint32", 1), "UINT64_T": ("uint64", 1),
}  # fmt: skip
# The MPI window of that memory, the communicator's size and its C handle; kept until the
# process ends (never freed: the handler may use it until then). And whether it is on.
_shared: tuple[Any, int, int] | None = None
_shared_on = False


def share(MPI: Any, comm: Communicator, one_node: bool) -> None:
    """Collective over ``comm``: where jaxddp's handler is in use and the ranks of ``comm``
    are all on this node (``one_node``, the same on every rank), 2 to
    :data:`MAX_SHARED_RANKS` of them, gives the handler memory they share (an MPI
    shared-memory window: two :data:`SLOT_BYTES` slots per rank and a header) and turns its
    shared-memory allreduce on for ``comm``. Where some rank cannot allocate the window, no
    rank uses it, nor where some rank turned it off (``JAXDDP_SHARED_ALLREDUCE``)."""
    global _shared
    size, rank = comm.Get_size(), comm.Get_rank()
    if _library is None or allreduce_target() is None or not one_node:
        return
    if not 1 < size <= MAX_SHARED_RANKS:
        return
    # the ranks agreed on the setting at start-up (_runtime.agreement); LAND is a second guard
    if not comm.allreduce(_settings.shared_allreduce(), op=MPI.LAND):
        return
    header = _library.jaxddp_native_header_bytes(size)  # the bell, the records, the texts
    nbytes = header + 2 * size * SLOT_BYTES
    window = memory = None
    try:
        window = MPI.Win.Allocate_shared(nbytes if rank == 0 else 0, 1, comm=comm)
        memory, _ = window.Shared_query(0)
        if rank == 0:
            ctypes.memset(memory.address, 0, header)
    except Exception:  # noqa: BLE001 - whatever failed, this rank cannot share: none does
        memory = None
    # Every rank or none (a rank alone would wait for ever), and zeroed before any counts.
    # A window some rank could not use is left as it is (freeing it is collective), as a
    # window in use is kept: until the process ends.
    if not comm.allreduce(memory is not None, op=MPI.LAND) or memory is None:
        return
    names = list(_KINDS)
    int64s = ctypes.c_int64 * len(names)
    _library.jaxddp_native_share(
        memory.address,
        memory.address + header,  # the slots
        _mpi.c_handle(comm),
        size,
        rank,
        SLOT_BYTES,
        int64s(*[_mpi.c_handle(getattr(MPI, name)) for name in names]),
        int64s(*[_library.jaxddp_native_kind(_KINDS[name][0].encode()) for name in names]),
        int64s(*[_KINDS[name][1] for name in names]),
        len(names),
        (ctypes.c_int64 * 3)(*[_mpi.c_handle(op) for op in (MPI.SUM, MPI.MAX, MPI.MIN)]),
    )
    _library.jaxddp_native_share_on(1)
    _shared = (window, size, _mpi.c_handle(comm))
    _set_on(True)


def _set_on(on: bool) -> None:
    global _shared_on
    _shared_on = on


def _share_on(on: bool) -> None:
    """Turns the shared-memory allreduce off and on again (benchmarks compare it with MPI's).
    Every rank must do it at the same point, with no allreduce in flight. A program compiled
    while it was on keeps floats' maxima and minima as floats (see :func:`shares`): run
    through MPI, its NaN follows MPI's rule."""
    if _library is not None and _shared is not None:
        _library.jaxddp_native_share_on(int(on))
        _set_on(on)


def shares(comm_handle: int) -> bool:
    """Whether jaxddp's handler reduces sums, maxima and minima over the communicator with
    this C handle in shared memory (where a NaN on any rank is a maximum's or minimum's
    result already, so the lowering sends floats as they are)."""
    return _shared is not None and _shared_on and _shared[2] == comm_handle


def shared_calls() -> list[int] | None:
    """How many slots' worth of allreduce each rank of this node has put through the shared
    memory (modulo 2**32; an allreduce larger than a slot counts once per slot); None where
    there is none."""
    if _shared is None or _library is None:
        return None
    return [_library.jaxddp_native_shared_arrivals(r) for r in range(_shared[1])]
