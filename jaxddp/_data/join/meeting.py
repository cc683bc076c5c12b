"""Every rank's value, or an error naming the ranks that did not come: the gather of
:meth:`~jaxddp.JoinedStream.state_dict`, a collective that a save guarded by
``if rank == 0:`` calls on one rank alone.

Each rank sends its value to every other rank and takes theirs, one message per pair,
without a collective: a rank that never comes leaves the others a receive they can give
up on (a collective left half-done would meet the next collective of the ranks that did
not come). A rank waits at most :func:`timeout` seconds; then it knows exactly whose
values did not arrive and names them. Each value travels with a stamp saying which call it
answers (the join's serial and step), so that what a call given up on sent is recognized
and dropped by the next call of the ranks it never reached.
"""

from __future__ import annotations

import time
from typing import Any

from ..._base import settings as _settings

__all__ = ["TAG", "gather", "timeout"]

# On jaxddp's check communicator, whose other traffic (the checks' gathers) has no tag.
TAG = 0x4A4F  # "JO"

_sends: list[Any] = []  # sent values not yet received, kept until they are


def timeout(env: Any = None) -> float:
    """Seconds a rank waits: ``JAXDDP_CHECK_TIMEOUT``, but at most half of
    ``JAXDDP_STALL_ABORT`` when that is set, so that the error naming the absent ranks
    comes before the stall inspector ends the job.

    Example:
      >>> timeout({}), timeout({"JAXDDP_STALL_ABORT": "40"}), timeout({"JAXDDP_CHECK_TIMEOUT": "5"})
      (60.0, 20.0, 5.0)
    """
    limit = _settings.check_timeout(env)
    abort = _settings.stall_abort(env)
    return limit if abort is None else min(limit, abort / 2)


def gather(comm: Any, mine: Any, *, stamp: tuple[int, ...], call: str) -> list[Any]:
    """Every rank's ``mine``, in rank order, on every rank of ``comm``; raises TimeoutError
    naming ``call`` and the ranks that did not call it within :func:`timeout` seconds, and
    ValueError when a rank called it at a later ``stamp`` (another step) than this one."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return [mine]
    global _sends
    _sends = [(request, value) for request, value in _sends if not request.Test()]
    message = (stamp, mine)
    peers = [r for r in range(size) if r != rank]
    for r in peers:
        _sends.append((comm.isend(message, dest=r, tag=TAG), message))
    got = {rank: mine}
    limit = timeout()
    capped = limit < _settings.check_timeout()
    deadline = time.monotonic() + limit
    pause = 1e-5
    while True:
        for r in peers:
            while r not in got:
                found = comm.improbe(source=r, tag=TAG)
                if found is None:
                    break
                theirs, value = found.recv()
                if tuple(theirs) == stamp:
                    got[r] = value
                elif tuple(theirs) > stamp:
                    msg = (
                        f"Expected every rank to call {call} at the same step, got rank {r} "
                        f"at {_where(theirs)} and rank {rank} at {_where(stamp)} instead: "
                        "call it on every rank at the same point of the loop."
                    )
                    raise ValueError(msg)
                # else: sent by a call that was given up on (its stamp is older): dropped
        if len(got) == size:
            return [got[r] for r in range(size)]
        if time.monotonic() > deadline:
            absent = [r for r in peers if r not in got]
            ranks = ", ".join(map(str, absent))
            msg = (
                f"{call} on rank {rank} waited {limit:g} s for rank{'s' * (len(absent) > 1)} "
                f"{ranks}, which did not call it: it is a collective (every rank gives its "
                "stream's position), so call it on every rank, not under `if rank == 0:` "
                "(the state it returns is the same on every rank: the rank that writes a "
                f"checkpoint holds it all). If those ranks are only slow, raise "
                f"{_settings.CHECK_TIMEOUT.name}=<seconds>"
                + (f" and {_settings.STALL_ABORT.name}, of which it waits half" * capped)
                + "."
            )
            raise TimeoutError(msg)
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


def _where(stamp: Any) -> str:
    serial, steps = stamp
    return f"step {steps} of join number {serial}"
