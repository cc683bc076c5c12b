"""Do all ranks agree? An error in seconds instead of a deadlock.

Ranks that pass trees of different structure, shapes or dtypes to a collective call
different MPI operations and wait for each other forever. :func:`check_same_tree` compares
a digest of every rank's tree (paths, shapes, dtypes: never values) and, on a difference,
raises :class:`TreeMismatchError` on every rank naming the first differing path.

Every such check (the tree check, :func:`synchronize`, the sampler's checks of its
arguments and of a loaded state in :mod:`jaxddp._data.agreement`) goes through
:func:`gather_with_deadline`: a rank that never arrives makes the others raise TimeoutError
within ``JAXDDP_CHECK_TIMEOUT`` seconds instead of waiting forever.

:func:`roll_call` opens a collective call that a program may call on some ranks only (the
methods of ``jaxddp.CheckpointManager``, put under ``if rank == 0:``): it names the ranks
that did not come, and the calls of ranks that came to another one.
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
    "roll_call",
    "roll_call_timeout",
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


# -- the roll call ------------------------------------------------------------------------

ROLL_CALL_TAG = 0x5243  # "RC", on jaxddp's check communicator (its gathers are collectives)
ROLL_CALL_GRACE = 1.0  # seconds the others wait beyond the timeout for the first rank's word
_roll_sends: list[Any] = []  # messages sent and not yet received, kept until they are


def roll_call_timeout(env: Any = None) -> float:
    """Seconds a roll call waits: ``JAXDDP_CHECK_TIMEOUT``, but at most half of
    ``JAXDDP_STALL_ABORT`` when that is set, so that the error naming the absent ranks
    comes before the stall inspector ends the job.

    Example:
      >>> roll_call_timeout({}), roll_call_timeout({"JAXDDP_STALL_ABORT": "40"})
      (60.0, 20.0)
    """
    limit = _settings.check_timeout(env)
    abort = _settings.stall_abort(env)
    return limit if abort is None else min(limit, abort / 2)


def roll_call(comm: Communicator, call: str, *, why: str, timeout: float | None = None) -> None:
    """Returns once every rank of ``comm`` has called ``call``; a collective.

    Each rank tells the first rank which call it is in, and the first rank answers every
    rank (point to point: a rank that never comes leaves nothing half-done but a message,
    where a collective would meet the next collective of the ranks that did not come). When
    a rank has not come within ``timeout`` seconds (:func:`roll_call_timeout` by default),
    the first rank and every rank that came raise TimeoutError naming ``call`` and the
    ranks that did not come; when some rank came to another call, ValueError naming each
    rank's call. ``why`` says, in the error, why the call is a collective. A rank whose
    first rank does not answer raises TimeoutError naming rank 0.

    Example:
      >>> from jaxddp._collectives import api
      >>> roll_call(api.py_comm(), "example()", why="it is one")  # a world of one: at once
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return
    global _roll_sends
    _roll_sends = [(r, m) for r, m in _roll_sends if not r.Test()]
    limit = roll_call_timeout() if timeout is None else timeout
    deadline = time.monotonic() + limit
    if rank != 0:
        _roll_sends.append((comm.isend(call, dest=0, tag=ROLL_CALL_TAG), call))
        verdict = _poll(comm, [0], deadline + ROLL_CALL_GRACE).get(0, _NO_ANSWER)
        if verdict is _NO_ANSWER:
            msg = (
                f"{call} on rank {rank} waited {limit:g} s for rank 0, which answers for every "
                f"rank: rank 0 did not call it, or waits for another rank that did not. {why}"
                f"{_raise_hint(limit)}"
            )
            raise TimeoutError(msg)
        if verdict is not None:
            kind, msg = verdict
            raise _ROLL_ERRORS[kind](msg)
        return
    calls = _poll(comm, list(range(1, size)), deadline)
    calls[0] = call
    absent = [r for r in range(size) if r not in calls]
    verdict: tuple[str, str] | None = None
    if any(c != call for c in calls.values()):
        verdict = ("mismatch", _mismatch(calls))
    elif absent:
        verdict = ("absent", _absent(call, absent, limit, why))
    for r in calls:
        if r != 0:
            _roll_sends.append((comm.isend(verdict, dest=r, tag=ROLL_CALL_TAG), verdict))
    if verdict is not None:
        raise _ROLL_ERRORS[verdict[0]](verdict[1])


_NO_ANSWER = object()
_ROLL_ERRORS: dict[str, type[Exception]] = {"absent": TimeoutError, "mismatch": ValueError}


def _poll(comm: Communicator, sources: list[int], deadline: float) -> dict[int, Any]:
    """The message of each of ``sources`` that arrives before ``deadline``."""
    got: dict[int, Any] = {}
    pause = 1e-5
    while True:
        for r in sources:
            if r not in got:
                found = comm.improbe(source=r, tag=ROLL_CALL_TAG)
                if found is not None:
                    got[r] = found.recv()
        if len(got) == len(sources) or time.monotonic() > deadline:
            return got
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


def _ranks(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 1, 2 and 3``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _raise_hint(limit: float) -> str:
    capped = limit < _settings.check_timeout()
    return (
        f" If they are only slow, raise {TIMEOUT_VARIABLE}=<seconds>"
        + (f" and {_settings.STALL_ABORT.name}, of which it waits half" if capped else "")
        + "."
    )


def _absent(call: str, absent: list[int], limit: float, why: str) -> str:
    verb = "has" if len(absent) == 1 else "have"
    return (
        f"{call} waited {limit:g} s on rank 0 for {_ranks(absent)}, which {verb} not called "
        f"it. {why}{_raise_hint(limit)}"
    )


def _mismatch(calls: dict[int, str]) -> str:
    by_call: dict[str, list[int]] = {}
    for r in sorted(calls):
        by_call.setdefault(calls[r], []).append(r)
    seen = "; ".join(f"{_ranks(rs)} in {c}" for c, rs in by_call.items())
    return (
        f"Expected every rank in the same collective call, got {seen}: call them on every "
        "rank, in the same order."
    )


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
