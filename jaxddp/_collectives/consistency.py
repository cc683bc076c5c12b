"""Do all ranks agree? An error in seconds instead of a deadlock.

Ranks that pass trees of different structure, shapes or dtypes to a collective call
different MPI operations and wait for each other forever. :func:`check_same_tree` compares
a digest of every rank's tree (paths, shapes, dtypes: never values) and, on a difference,
raises :class:`TreeMismatchError` on every rank naming the first differing path.

Every such check (the tree check, :func:`synchronize`, the sampler's checks of its
arguments and of a loaded state in :mod:`jaxddp._data.agreement`) goes through
:func:`gather_with_deadline`: a rank that never arrives makes the others raise TimeoutError
within ``JAXDDP_CHECK_TIMEOUT`` seconds instead of waiting forever.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from typing import Any

import numpy as np

from .._base import settings as _settings
from .._runtime import world as _world
from .._types import Communicator, PyTree
from . import api as _comm
from .signature import TreeMismatchError, describe_tree
from .signature import explain as _explain

__all__ = [
    "TreeMismatchError",
    "check_same_tree",
    "describe_tree",
    "gather_with_deadline",
    "synchronize",
]

TIMEOUT_VARIABLE = _settings.CHECK_TIMEOUT.name


# Requests given up on at their deadline, kept with their buffers: MPI may still write into
# them if the missing ranks arrive later, so they must never be freed.
_abandoned: list[Any] = []


def _allgather_with_deadline(
    comm: Communicator, mine: bytes, timeout: float, what: str, error: type[Exception]
) -> list[bytes]:
    """Allgathers a fixed-size byte string; raises ``error`` if the others do not come in time."""
    size = comm.Get_size()
    send = np.frombuffer(mine, dtype=np.uint8)
    recv = np.empty(size * send.size, dtype=np.uint8)
    request = comm.Iallgather(send, recv)
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not request.Test():
        if time.monotonic() > deadline:
            _abandoned.append((request, send, recv))
            msg = (
                f"Rank {comm.Get_rank()} waited {timeout:g} s in jaxddp's check of the {what} "
                "and not every rank arrived: some rank is running different code (another "
                "branch, a loop that ended early, a step compiled again on some ranks only). "
                f"Raise the wait with {TIMEOUT_VARIABLE}=<seconds> if the ranks are just slow."
            )
            raise error(msg)
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return [bytes(chunk) for chunk in recv.reshape(size, send.size)]


def gather_with_deadline(
    comm: Communicator,
    mine: Any,
    *,
    what: str,
    timeout: float | None = None,
    error: type[Exception] = TreeMismatchError,
) -> list[Any]:
    """Every rank's ``mine`` (any picklable value), in rank order; a collective over ``comm``.

    First every rank's digest of ``mine`` travels with a deadline (``timeout`` seconds,
    ``JAXDDP_CHECK_TIMEOUT`` by default): a rank that does not arrive in time makes the
    others raise ``error``, naming the check (``what``). When the digests agree that is all,
    and ``mine`` is returned for every rank; otherwise, every rank being there, the values
    themselves are gathered.

    Example:
      >>> from jaxddp._collectives import api
      >>> gather_with_deadline(api.py_comm(), ("n", 7), what="example")
      [('n', 7)]
    """
    if timeout is None:
        timeout = _settings.check_timeout()
    if comm.Get_size() == 1:
        return [mine]
    digest = hashlib.sha256(pickle.dumps(mine)).digest()
    digests = _allgather_with_deadline(comm, digest, timeout, what, error)
    if len(set(digests)) == 1:
        return [mine] * len(digests)
    return comm.allgather(mine)


def check_same_tree(
    tree: PyTree,
    *,
    what: str = "tree",
    timeout: float | None = None,
    comm: Communicator | None = None,
) -> None:
    """Raises :class:`TreeMismatchError` on every rank unless all ranks' trees match, and
    TimeoutError when some rank does not arrive within ``JAXDDP_CHECK_TIMEOUT`` seconds.

    A collective over ``comm`` (jaxddp's private communicator by default): every rank of it
    must call it. On a user's communicator it runs on a private duplicate of it. It compares
    paths, shapes and dtypes, never values, so it works on tracers at trace time inside
    ``jax.jit`` and costs one small allgather.

    Example:
      >>> import jax.numpy as jnp
      >>> check_same_tree({"w": jnp.zeros(3)})  # passes on a world of one
    """
    private = _world.check_comm(comm)
    if private.Get_size() == 1:
        return
    descriptions = gather_with_deadline(
        private, describe_tree(tree), what=what, timeout=timeout, error=TimeoutError
    )
    if all(d == descriptions[0] for d in descriptions):
        return
    raise TreeMismatchError(_explain(descriptions, what))


def synchronize(tree: PyTree, root: int = 0, *, comm: Communicator | None = None) -> Any:
    """Checks that every rank holds a tree of the same shape, then gives all ``root``'s values.

    Use it once before training, on the parameters and the optimizer state, so every rank
    starts from the same point. Leaves that are not arrays or numbers are returned
    unchanged. Raises :class:`TreeMismatchError` on every rank if the trees differ, and
    TimeoutError if some rank does not arrive within ``JAXDDP_CHECK_TIMEOUT`` seconds.

    Args:
      tree: a pytree; every rank of ``comm`` must pass one of the same structure.
      root: the rank of ``comm`` whose values everyone gets.
      comm: an mpi4py communicator; by default the whole world. Only its ranks take part,
        and ``root`` is a rank of it.

    Example:
      >>> import jax.numpy as jnp, optax, jaxddp
      >>> params = {"w": jnp.ones((2, 2))}
      >>> opt_state = optax.adam(1e-3).init(params)
      >>> params, opt_state = jaxddp.synchronize((params, opt_state))
      >>> params["w"].shape
      (2, 2)
    """
    check_same_tree(tree, what="tree passed to synchronize", comm=comm)
    return _comm.broadcast(tree, root, comm=comm)
