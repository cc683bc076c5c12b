"""What the ranks say at each step of :func:`jaxddp.join`, and how it travels."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..._collectives.consistency import TreeMismatchError
from .batches import StreamError

__all__ = ["BATCH", "ENDED", "FAILED", "KINDS", "abandoned", "error_payload", "wait", "wire"]

# What each rank says of a step, one byte per rank.
ENDED, BATCH, FAILED = 0, 1, 2

KINDS: dict[str, type[Exception]] = {
    "TreeMismatchError": TreeMismatchError,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


def error_payload(problem: BaseException) -> tuple[str, str, bool]:
    """What the other ranks learn of this rank's failure: its type, text, and whether it
    is one of jaxddp's checks (raised as the same type everywhere)."""
    if isinstance(problem, StreamError):
        return problem.kind.__name__, str(problem), True
    return type(problem).__name__, str(problem), False


# Up to this many ranks, a step's bytes go straight from every rank to every other (one
# round: each arrives with its sender's post, and one look of the receiver completes it);
# above it, as MPI's non-blocking allgather (rounds that each wait for a look of some rank,
# but a number of messages that grows with log(ranks), not with ranks). At 4 ranks the
# allgather's rounds left 50-65% of the waits not complete when their step came (the ranks'
# Python a third of a step apart); see docs/benchmarks.
DIRECT_RANKS = 16


class Slot:
    """One step's bytes in flight: this rank's status to every other rank, every rank's
    status in ``statuses`` (rank order). Reused step after step; persistent requests where
    the bytes go straight (:data:`DIRECT_RANKS`)."""

    def __init__(self, comm: Any, tag: int) -> None:
        from mpi4py import MPI

        self.comm, self.rank, size = comm, comm.Get_rank(), comm.Get_size()
        self.send = np.zeros(1, np.int8)
        self.statuses = np.zeros(size, np.int8)
        self.request: Any = None  # the allgather's, above DIRECT_RANKS
        self.direct: list[Any] = []
        if 1 < size <= DIRECT_RANKS:
            peers = [r for r in range(size) if r != self.rank]
            byte = MPI.INT8_T
            self.direct = [comm.Send_init([self.send, byte], dest=r, tag=tag) for r in peers]
            self.direct += [
                comm.Recv_init([self.statuses[r : r + 1], byte], source=r, tag=tag) for r in peers
            ]
        self._MPI = MPI

    def start(self, status: int) -> None:
        self.send[0] = self.statuses[self.rank] = status
        if self.direct:
            self._MPI.Prequest.Startall(self.direct)
        elif self.statuses.size > 1:
            self.request = self.comm.Iallgather(self.send, self.statuses)

    def test(self) -> bool:
        """Whether every rank's byte is here (and MPI moved everything in flight along)."""
        if self.direct:
            return self._MPI.Request.Testall(self.direct)
        return self.request is None or self.request.Test()

    def free(self) -> None:
        """Lets go of the persistent requests; only when nothing is in flight."""
        for request in self.direct:
            request.Free()
        self.direct = []


def wait(slot: Slot) -> None:
    """Waits for a step's bytes, first looking a few times in a row, then asleep between
    looks. They are almost always there: a rank's bytes were posted steps ago, but MPI
    often completes a request only at the second look after they arrived (measured at 4
    ranks: 75% of the steps needed that second look, a second look and no more in 90%).
    Asleep at once, such a step lost a nap of 0.1 ms or more; waiting in MPI instead polls
    a core the ranks' compiled steps, still running, may need."""
    spin_until = time.perf_counter() + SPIN
    while time.perf_counter() < spin_until:
        if slot.test():
            return
    pause = 1e-4
    while not slot.test():
        time.sleep(pause)
        pause = min(2 * pause, 2e-3)


SPIN = 50e-6  # seconds of looks in a row before the first nap


_wires: dict[int, tuple[Any, Any]] = {}
abandoned: list[Any] = []  # bytes in flight of loops left early, kept with their buffers


def wire(check: Any) -> Any:
    """The communicator of the per-step bytes over ``check``'s ranks: a duplicate made at
    the first step of the first join on it (a collective point), so that they never
    interleave with other traffic."""
    found = _wires.get(id(check))
    if found is None:
        found = _wires[id(check)] = (check, check.Dup())
    return found[1]
