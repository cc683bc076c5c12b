"""The record of every ``JAXDDP_*`` environment variable: its name, what it takes, its
default and its effect (``docs/settings.md`` lists the same table). Read by the parsers of
:mod:`jaxddp._base.settings`."""

from __future__ import annotations

import dataclasses
import enum

__all__ = [
    "ABORT_ON_ERROR",
    "CHECK",
    "CHECK_TIMEOUT",
    "COLLECTIVES",
    "CUDA_AWARE_MPI",
    "GPUS",
    "NATIVE_ALLREDUCE",
    "SETTINGS",
    "SHARED_ALLREDUCE",
    "SKIP_LAUNCHER_CHECK",
    "STALL_ABORT",
    "STALL_WARN",
    "STARTUP_TIMEOUT",
    "Setting",
    "SkipLevel",
]


class SkipLevel(enum.Enum):
    """How much of the launcher check ``JAXDDP_SKIP_LAUNCHER_CHECK`` turns off."""

    NONE = "check"  # both checks run
    INIT = "init"  # the check before MPI_Init is skipped; the silent-singleton check runs
    ALL = "all"  # both are skipped


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: its name, the values it takes, its default, its effect."""

    name: str
    accepts: str
    default: str
    effect: str


SKIP_LAUNCHER_CHECK = Setting(
    "JAXDDP_SKIP_LAUNCHER_CHECK",
    "a boolean, or `all`",
    "off",
    "On: skip the launcher check before `MPI_Init` (for an MPI build it misjudges). `all`: "
    "also skip the silent-singleton check after it (a world of 1 although the launcher "
    "started more processes).",
)
CHECK = Setting(
    "JAXDDP_CHECK",
    "a boolean",
    "on",
    "Every collective (`allreduce`, `broadcast`, `reduce`, `masked_mean`, "
    "`allreduce_gradients()`, whose `check=` overrides it) first makes the ranks agree on its "
    "signature (tree, shapes, dtypes, `op`, `root`) and raises `TreeMismatchError` on every "
    "rank instead of reducing garbage, aborting in MPI or hanging. Under `jax.jit` it runs "
    "once per compilation; outside it, a few metrics travel with the check in one message "
    "and larger data after it. Read once, at the first collective; when jaxddp's world "
    "starts, every rank must have the same value, or every rank raises `SettingError` "
    "naming each rank's.",
)
CHECK_TIMEOUT = Setting(
    "JAXDDP_CHECK_TIMEOUT",
    "a positive number of seconds (`inf` waits forever)",
    "60",
    "How long a consistency check (the tree check, `synchronize`, the sampler's argument "
    "check) waits for every rank before raising an error that says some rank never arrived.",
)
ABORT_ON_ERROR = Setting(
    "JAXDDP_ABORT_ON_ERROR",
    "a boolean",
    "on",
    "An uncaught exception on one rank of a world of more than one prints its traceback and "
    "ends every rank with `MPI_Abort`, instead of leaving the others waiting forever.",
)

STALL_WARN = Setting(
    "JAXDDP_STALL_WARN",
    "a number of seconds, `0` for off",
    "60",
    "When no rank has made progress (a batch drawn from a `DistributedSampler`, a jaxddp "
    "collective called from Python, `jaxddp.heartbeat()`) for this long, rank 0 prints a "
    "stall report: every rank's progress and where its main thread is, the ranks behind "
    "first; at most once per this many seconds. `0` turns the stall inspector off. See "
    "[When a job hangs](hangs.md).",
)
STALL_ABORT = Setting(
    "JAXDDP_STALL_ABORT",
    "a number of seconds, `0` or `off` for off",
    "off",
    "After this long without progress on any rank, print the stall report and end every "
    "rank with `MPI_Abort` (exit status non-zero). Also the start-up limit below, when set.",
)
STARTUP_TIMEOUT = Setting(
    "JAXDDP_STARTUP_TIMEOUT",
    "a positive number of seconds (`inf` waits forever)",
    "300",
    "How long a rank waits in `MPI_Init` for the others (`JAXDDP_STALL_ABORT` instead, when "
    "set) before it gives up with a message that some rank probably died before starting "
    "MPI, and is killed.",
)
NATIVE_ALLREDUCE = Setting(
    "JAXDDP_NATIVE_ALLREDUCE",
    "a boolean",
    "on",
    "Allreduces inside `jax.jit` (on CPU) run jaxddp's own XLA handler, built on first use "
    "with the C++ compiler (`$CXX` or `c++`) into `~/.cache/jaxddp/native` (or "
    "`$XDG_CACHE_HOME`'s): its wait gives a shared core back to the Python thread instead of "
    "yielding it for whole time slices (see [Benchmarks](benchmarks/index.md)), in naps that "
    "grow to 0.5 ms, or stay at 20 µs for a message of 1 MiB or more, whose bytes over TCP "
    "move only while the wait polls. Off, or where "
    "some rank cannot build or load it, every rank uses mpi4jax's handler; `jaxddp doctor` "
    "says which. Read once, when jaxddp's world starts; every rank must have the same value, "
    "or every rank raises `SettingError` naming each rank's.",
)
SHARED_ALLREDUCE = Setting(
    "JAXDDP_SHARED_ALLREDUCE",
    "a boolean",
    "on",
    "Where every rank is on one node (2 to 8 ranks) and jaxddp's handler is in use, jitted "
    "allreduces of sums, maxima and minima go through memory the ranks share (an MPI "
    "shared-memory window of 2 MiB per rank, made when jaxddp's world starts) instead of "
    "through MPI: a rank copies its part in, sleeps until the last rank has copied, and adds "
    "every rank's part in rank order, so every rank holds the same bits. Where the ranks' "
    "calls at the same point differ in count, dtype (as the caller asked: bfloat16 is not "
    "float32), shape or op (`mean` is not `sum`), a call of no element included, each gets "
    "an error naming both calls (jaxddp's signature check, `JAXDDP_CHECK`, catches that "
    "earlier; see [Sharp bits](sharp-bits.md) for what is compared without it). Read once, when jaxddp's world starts; every rank must have the same value, "
    "or every rank raises `SettingError` naming each rank's.",
)
CUDA_AWARE_MPI = Setting(
    "JAXDDP_CUDA_AWARE_MPI",
    "a boolean",
    "on",
    "On a GPU, jaxddp's collectives copy each buffer to pinned host memory, reduce it there "
    "and copy the result back (host staging), unless the MPI library says it takes GPU "
    "memory (`MPIX_Query_cuda_support`, on every rank): then MPI gets the GPU buffers "
    "themselves. Off: always host staging. See [GPUs](gpus.md).",
)
GPUS = Setting(
    "JAXDDP_GPUS",
    "`auto` or `off`",
    "auto",
    "`auto`: where JAX has a CUDA plugin, `import jaxddp` gives each rank one GPU before JAX "
    "starts (`jax_cuda_visible_devices`): the ranks of a node take its GPUs in turn, by "
    "node-local rank; where a rank sees one GPU only (Slurm's `--gpus-per-task=1`), it keeps "
    "it. Where several ranks share a GPU and neither `XLA_PYTHON_CLIENT_PREALLOCATE` nor "
    "`XLA_PYTHON_CLIENT_MEM_FRACTION` is set, their JAX does not preallocate GPU memory "
    "(`XLA_PYTHON_CLIENT_PREALLOCATE=false`), so that they fit. `off`: jaxddp leaves the "
    "choice of devices and memory to JAX. `jaxddp doctor` shows what each rank got.",
)
COLLECTIVES = Setting(
    "JAXDDP_COLLECTIVES",
    "`mpi` or `xla`",
    "mpi",
    "Where the collectives of a step wrapped in `jaxddp.spmd` run. `mpi`: through MPI, as "
    "everywhere else. `xla`: `import jaxddp` starts JAX's distributed runtime from the MPI "
    "world, and the step runs over a mesh of the ranks' devices with JAX's own collectives "
    "(NCCL on GPUs, gloo on CPUs). See [XLA collectives](xla.md). Every rank must have the "
    "same value, or every rank raises `SettingError` naming each rank's.",
)

SETTINGS = (
    SKIP_LAUNCHER_CHECK,
    CHECK,
    CHECK_TIMEOUT,
    ABORT_ON_ERROR,
    STALL_WARN,
    STALL_ABORT,
    STARTUP_TIMEOUT,
    NATIVE_ALLREDUCE,
    SHARED_ALLREDUCE,
    CUDA_AWARE_MPI,
    GPUS,
    COLLECTIVES,
)
