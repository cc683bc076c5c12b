"""jaxddp: data-parallel training of JAX models over MPI, without the deadlocks.

Importing jaxddp checks the launcher against the MPI library (before MPI starts), then
initializes MPI as ``from mpi4py import MPI`` would, so the program's own mpi4py code works
right away. A program that set ``mpi4py.rc.initialize = False`` first keeps MPI
uninitialized until the first jaxddp call that needs the world.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING

from . import _jax_compat, _world
from ._checkpoint import CheckpointManager as CheckpointManager
from ._checkpoint import DamagedCheckpointError as DamagedCheckpointError
from ._comm import allreduce as allreduce
from ._comm import broadcast as broadcast
from ._comm import local_rank as local_rank
from ._comm import rank as rank
from ._comm import reduce as reduce
from ._comm import world_size as world_size
from ._consistency import TreeMismatchError as TreeMismatchError
from ._consistency import synchronize as synchronize
from ._gradients import allreduce_gradients as allreduce_gradients
from ._gradients import resolve_unused_parameters as resolve_unused_parameters
from ._join import JoinedStream as JoinedStream
from ._join import join as join
from ._launcher import LauncherMismatchError as LauncherMismatchError
from ._launcher import LauncherReport as LauncherReport
from ._launcher import LauncherWarning as LauncherWarning
from ._launcher import check_launcher as check_launcher
from ._metrics import masked_mean as masked_mean
from ._progress import heartbeat as heartbeat
from ._sampler import DistributedSampler as DistributedSampler
from ._sharded import ShardedOptimizer as ShardedOptimizer
from ._sharded import ShardedState as ShardedState
from ._sharded import shard_optimizer as shard_optimizer
from ._state import average_state as average_state

if TYPE_CHECKING:  # imported on first use (it needs flax): see __getattr__
    from ._batchnorm import LinenSyncBatchNorm as LinenSyncBatchNorm
    from ._batchnorm import SyncBatchNorm as SyncBatchNorm

try:
    __version__ = _version("jaxddp")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

# Before anything imports mpi4jax: its warning about a JAX newer than it knows is silenced
# where jaxddp verified that pair; a JAX jaxddp was not verified on is warned about once.
_jax_compat.silence_mpi4jax_version_warning()
_jax_compat.warn_if_unverified()
_world.start()


def __getattr__(name: str) -> object:
    # The batch norms need flax: imported on first use, so that `import jaxddp` does not.
    if name in ("SyncBatchNorm", "LinenSyncBatchNorm"):
        from . import _batchnorm

        return getattr(_batchnorm, name)
    msg = f"module 'jaxddp' has no attribute {name!r}"
    raise AttributeError(msg)


__all__ = [
    "CheckpointManager",
    "DamagedCheckpointError",
    "DistributedSampler",
    "JoinedStream",
    "LauncherMismatchError",
    "LauncherReport",
    "LauncherWarning",
    "LinenSyncBatchNorm",
    "ShardedOptimizer",
    "ShardedState",
    "SyncBatchNorm",
    "TreeMismatchError",
    "__version__",
    "allreduce",
    "allreduce_gradients",
    "average_state",
    "broadcast",
    "check_launcher",
    "heartbeat",
    "join",
    "local_rank",
    "masked_mean",
    "rank",
    "reduce",
    "resolve_unused_parameters",
    "shard_optimizer",
    "synchronize",
    "world_size",
]
