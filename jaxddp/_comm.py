"""MPI start-up after the launcher guard, the world's shape, and pytree collectives.

Nothing here touches MPI at import time. MPI is loaded (without being initialized) by
:func:`mpi`, and initialized once by :func:`init`, which every function that needs the world
calls first. mpi4jax is imported only after that, because importing it initializes MPI.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _launcher

__all__ = ["allreduce", "init", "local_rank", "mpi", "rank", "world_size"]

_OPS = ("sum", "mean", "max", "min")

_lock = threading.RLock()
_world: _World | None = None


class _World:
    """What :func:`init` learned about the MPI world, computed once."""

    def __init__(self, MPI: ModuleType) -> None:
        world = MPI.COMM_WORLD
        self.rank: int = world.Get_rank()
        self.size: int = world.Get_size()
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = node.Get_rank()
        self.local_size: int = node.Get_size()
        node.Free()
        # Two private communicators: one for mpi4py calls made from Python, one for mpi4jax
        # calls made from compiled code. Sharing one between the two can mix up messages.
        self.py_comm = world.Clone()
        self.jax_comm = world.Clone()


def mpi() -> ModuleType:
    """Returns ``mpi4py.MPI``, loaded without initializing MPI if it was not loaded yet."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True  # finalize at exit, since we initialize
    from mpi4py import MPI

    return MPI


def init() -> _World:
    """Initializes MPI once (after the launcher guard) and returns what it learned.

    Safe to call many times. Every rank must reach it, as every rank must reach ``MPI_Init``.
    """
    global _world
    if _world is not None:
        return _world
    with _lock:
        if _world is None:
            MPI = mpi()
            if not MPI.Is_initialized():
                _launcher.guard(MPI)
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
            world = _World(MPI)
            _launcher.check_world_size(world.size)
            _world = world
            _install_abort_on_error(world)
    return _world


def rank() -> int:
    """This process's rank in the MPI world (0 without a launcher)."""
    return init().rank


def world_size() -> int:
    """The number of ranks in the MPI world (1 without a launcher)."""
    return init().size


def local_rank() -> int:
    """This process's rank among the ranks on the same node (useful to pick a GPU)."""
    return init().local_rank


def py_comm() -> Any:
    """jaxddp's private communicator for mpi4py calls made from Python."""
    return init().py_comm


def jax_comm() -> Any:
    """jaxddp's private communicator for mpi4jax calls made from compiled code."""
    return init().jax_comm


def mpi4jax() -> ModuleType:
    """Imports mpi4jax, after MPI has been initialized by :func:`init`."""
    init()
    import mpi4jax as m

    return m


def _mpi_op(op: str) -> Any:
    MPI = mpi()
    return {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]


def check_op(op: str) -> str:
    """Validates a reduction name; returns it."""
    if op not in _OPS:
        msg = f"Expected `op` to be one of {', '.join(map(repr, _OPS))}, got {op!r} instead."
        raise ValueError(msg)
    return op


def allreduce(tree: Any, op: str = "mean", *, comm: Any = None) -> Any:
    """Reduces every leaf of a pytree across all ranks; usable inside and outside ``jax.jit``.

    Args:
      tree: a pytree of arrays or numbers. Each leaf is reduced separately; shapes and
        dtypes are kept, except that ``"mean"`` of an integer leaf is a float leaf, as with
        ``jnp.mean``.
      op: ``"sum"``, ``"mean"`` (sum divided by the world size), ``"max"`` or ``"min"``.
      comm: an mpi4py communicator to reduce over; by default jaxddp's private clone of
        ``COMM_WORLD``. Do not use the same communicator for mpi4py calls.

    Returns:
      A pytree of the same structure holding the reduced values, identical on every rank.

    Example:
      >>> import jax, jax.numpy as jnp, jaxddp
      >>> tree = {"w": jnp.ones(3), "step": jnp.int32(2)}
      >>> out = jax.jit(lambda t: jaxddp.allreduce(t, op="sum"))(tree)
      >>> out["w"].tolist() == [float(jaxddp.world_size())] * 3
      True
    """
    check_op(op)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if comm is None:
        size = world_size()
        comm = jax_comm() if size > 1 else None
    else:
        size = comm.Get_size()
    out = []
    for leaf in leaves:
        x = jnp.asarray(leaf)
        if size > 1:
            x = mpi4jax().allreduce(x, _mpi_op(op), comm=comm)
        if op == "mean":
            x = x / size if jnp.issubdtype(x.dtype, jnp.inexact) else x / np.float32(size)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def _install_abort_on_error(world: _World) -> None:
    """Makes an uncaught exception on one rank end the whole job instead of hanging it.

    Without this, the other ranks wait forever in their next collective. The rank's
    traceback is printed first; ``JAXDDP_ABORT_ON_ERROR=0`` leaves ``sys.excepthook`` alone.
    """
    if world.size == 1 or os.environ.get("JAXDDP_ABORT_ON_ERROR", "1") == "0":
        return
    previous = sys.excepthook

    def abort_on_error(exc_type: Any, exc: Any, tb: Any) -> None:
        previous(exc_type, exc, tb)
        sys.stderr.write(
            f"jaxddp: rank {world.rank} of {world.size} raised an uncaught exception; "
            "aborting every rank with MPI_Abort so that none waits forever "
            "(set JAXDDP_ABORT_ON_ERROR=0 to turn this off).\n"
        )
        sys.stderr.flush()
        mpi().COMM_WORLD.Abort(1)

    sys.excepthook = abort_on_error
