"""jaxddp: data-parallel training of JAX models over MPI, without the deadlocks.

Importing jaxddp checks the launcher against the MPI library (before MPI starts), then
initializes MPI as ``from mpi4py import MPI`` would, so the program's own mpi4py code works
right away. A program that set ``mpi4py.rc.initialize = False`` first keeps MPI
uninitialized until the first jaxddp call that needs the world.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING

from ._base.progress import heartbeat as heartbeat
from ._base.settings import SettingError as SettingError
from ._collectives._jax import compat as _jax_compat
from ._collectives.api import allreduce as allreduce
from ._collectives.api import broadcast as broadcast
from ._collectives.api import local_rank as local_rank
from ._collectives.api import rank as rank
from ._collectives.api import reduce as reduce
from ._collectives.api import world_size as world_size
from ._collectives.consistency import TreeMismatchError as TreeMismatchError
from ._collectives.consistency import synchronize as synchronize
from ._collectives.scatter_gather import all_gather as all_gather
from ._collectives.scatter_gather import reduce_scatter as reduce_scatter
from ._data.join import JoinedStream as JoinedStream
from ._data.join import join as join
from ._data.sampler import DistributedSampler as DistributedSampler
from ._runtime import distributed as _distributed
from ._runtime import world as _world
from ._runtime.launcher import LauncherMismatchError as LauncherMismatchError
from ._runtime.launcher import LauncherReport as LauncherReport
from ._runtime.launcher import LauncherWarning as LauncherWarning
from ._runtime.launcher import check_launcher as check_launcher
from ._training.checkpoint.manager import CheckpointManager as CheckpointManager
from ._training.checkpoint.manager import DamagedCheckpointError as DamagedCheckpointError
from ._training.compression import CompressionState as CompressionState
from ._training.compression import PowerSGD as PowerSGD
from ._training.gradients import allreduce_gradients as allreduce_gradients
from ._training.gradients import resolve_unused_parameters as resolve_unused_parameters
from ._training.metrics import masked_mean as masked_mean
from ._training.spmd import spmd as spmd
from ._training.state import average_state as average_state
from ._training.zero.optimizer import ShardedOptimizer as ShardedOptimizer
from ._training.zero.optimizer import ShardedState as ShardedState
from ._training.zero.optimizer import shard_optimizer as shard_optimizer

if TYPE_CHECKING:  # imported on first use (it needs flax): see __getattr__
    from ._training.batchnorm import LinenSyncBatchNorm as LinenSyncBatchNorm
    from ._training.batchnorm import SyncBatchNorm as SyncBatchNorm

try:
    __version__ = _version("jaxddp")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

# Before anything imports mpi4jax: its warning about a JAX newer than it knows is silenced
# where jaxddp verified that pair; a JAX jaxddp was not verified on is warned about once.
_jax_compat.silence_mpi4jax_version_warning()
_jax_compat.warn_if_unverified()
_distributed.backends_started = _jax_compat.backends_started  # before JAX's runtime may start
_world.start()


def __getattr__(name: str) -> object:
    # The batch norms need flax: imported on first use, so that `import jaxddp` does not.
    if name in ("SyncBatchNorm", "LinenSyncBatchNorm"):
        from ._training import batchnorm as _batchnorm

        return getattr(_batchnorm, name)
    msg = f"module 'jaxddp' has no attribute {name!r}"
    raise AttributeError(msg)


__all__ = [
    "CheckpointManager",
    "CompressionState",
    "DamagedCheckpointError",
    "DistributedSampler",
    "JoinedStream",
    "LauncherMismatchError",
    "LauncherReport",
    "LauncherWarning",
    "LinenSyncBatchNorm",
    "PowerSGD",
    "SettingError",
    "ShardedOptimizer",
    "ShardedState",
    "SyncBatchNorm",
    "TreeMismatchError",
    "__version__",
    "all_gather",
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
    "reduce_scatter",
    "resolve_unused_parameters",
    "shard_optimizer",
    "spmd",
    "synchronize",
    "world_size",
]
