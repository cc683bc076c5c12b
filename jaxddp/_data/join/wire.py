"""What the ranks say at each step of :func:`jaxddp.join`, and how it travels.

Each join talks on a channel of its own (:class:`Wire`), so that whatever an earlier join
left in flight (a loop left on different steps on different ranks leaves bytes sent that no
one will receive, and receives that no one will send to) can never be taken for its bytes:
up to :data:`DIRECT_RANKS` ranks, tags of its own on the communicator that every join over
the same ranks shares (a serial the ranks agree on at the first step picks them); above, a
duplicate communicator of its own, since MPI's allgather has no tag. A rank that leaves a
join before its end says so (:meth:`Wire.leave`): a rank still waiting for its bytes then
raises an error naming it instead of waiting forever.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ..._collectives.consistency import TreeMismatchError
from .batches import StreamError

__all__ = [
    "BATCH",
    "ENDED",
    "FAILED",
    "KINDS",
    "Left",
    "Wire",
    "error_payload",
    "next_serial",
    "wait",
]

# What each rank says of a step, one byte per rank.
ENDED, BATCH, FAILED = 0, 1, 2

KINDS: dict[str, type[Exception]] = {
    "TreeMismatchError": TreeMismatchError,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


def error_payload(problem: BaseException, reading: bool) -> tuple[str, str, bool, bool]:
    """What the other ranks learn of this rank's failure: its type, text, whether it is one
    of jaxddp's checks (raised as the same type everywhere), and whether it came from
    reading the batch into arrays (``reading``) rather than from the stream itself."""
    if isinstance(problem, StreamError):
        return problem.kind.__name__, str(problem), True, reading
    return type(problem).__name__, str(problem), False, reading


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
    the bytes go straight."""

    def __init__(self, comm: Any, tag: int, direct: bool) -> None:
        from mpi4py import MPI

        self.comm, self.rank, size = comm, comm.Get_rank(), comm.Get_size()
        self.send = np.zeros(1, np.int8)
        self.statuses = np.zeros(size, np.int8)
        self.request: Any = None  # the allgather's, above DIRECT_RANKS
        self.direct: list[Any] = []  # the sends, then the receives
        self.active = False  # started, not yet seen complete
        self.cancelled = False  # its receives cancelled: the join was left
        if direct:
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
            self.active = True
        elif self.statuses.size > 1:
            self.request = self.comm.Iallgather(self.send, self.statuses)
            self.active = True

    def test(self) -> bool:
        """Whether every rank's byte is here (and MPI moved everything in flight along)."""
        if not self.active:
            return True
        done = self._MPI.Request.Testall(self.direct) if self.direct else self.request.Test()
        self.active = not done
        return done

    def cancel(self) -> bool:
        """Gives up on the bytes in flight: cancels the receives (their bytes, if they come,
        match nothing: the tags are this join's); True once nothing is left in flight (the
        sends, one byte each, leave eagerly). An allgather cannot be cancelled: it stays in
        flight, with its communicator."""
        if not self.active:
            return True
        if not self.direct:
            return self.test()
        half = len(self.direct) // 2
        if not self.cancelled:
            for request in self.direct[half:]:
                request.Cancel()
            self._MPI.Request.Waitall(self.direct[half:])
            self.cancelled = True
        self.active = not self._MPI.Request.Testall(self.direct[:half])
        return not self.active

    def free(self) -> None:
        """Lets go of the persistent requests; only when nothing is in flight."""
        for request in self.direct:
            request.Free()
        self.direct = []


class Left(Exception):
    """A rank left the join (``rank``, after ``steps`` steps) before the step waited for."""

    def __init__(self, rank: int, steps: int) -> None:
        super().__init__(rank, steps)
        self.rank, self.steps = rank, steps


def wait(slot: Slot, wire: Wire, step: int) -> None:
    """Waits for step ``step``'s bytes, first looking a few times in a row, then asleep
    between looks. They are almost always there: a rank's bytes were posted steps ago, but
    MPI often completes a request only at the second look after they arrived (measured at 4
    ranks: 75% of the steps needed that second look, a second look and no more in 90%).
    Asleep at once, such a step lost a nap of 0.1 ms or more; waiting in MPI instead polls
    a core the ranks' compiled steps, still running, may need. Asleep, it also looks for a
    rank that left the join before posting this step's byte, and raises :class:`Left`."""
    spin_until = time.perf_counter() + SPIN
    while time.perf_counter() < spin_until:
        if slot.test():
            return
    pause = 1e-4
    while not slot.test():
        wire.check_left(step)
        time.sleep(pause)
        pause = min(2 * pause, 2e-3)


SPIN = 50e-6  # seconds of looks in a row before the first nap


# -- the channels -------------------------------------------------------------------------

_shared: dict[int, tuple[Any, Any]] = {}  # id(check) -> (check, its duplicate for the bytes)
_serials: dict[int, int] = {}  # id(check) -> the serial of the last join started over it
_leftovers: list[Any] = []  # what joins left in flight, kept with its buffers until done
_later: list[tuple[Wire, int, int]] = []  # joins dropped where MPI cannot be called


def next_serial(check: Any) -> int:
    """The serial this rank proposes for the next join over ``check``'s ranks."""
    return _serials.get(id(check), 0) + 1


class Wire:
    """One join's channel to the other ranks: ``slots`` slots taking turns, and a tag for
    the notice of a rank that leaves. Made at the first step (a collective point), with the
    ``serial`` the ranks agreed on."""

    def __init__(self, check: Any, serial: int, slots: int) -> None:
        from mpi4py import MPI

        _serials[id(check)] = max(serial, _serials.get(id(check), 0))
        settle()
        size = check.Get_size()
        self.direct = 1 < size <= DIRECT_RANKS
        self.own = size > DIRECT_RANKS
        base = 0
        if self.direct:
            found = _shared.get(id(check))
            if found is None:
                found = _shared[id(check)] = (check, check.Dup())
            self.comm = found[1]
            span = (int(self.comm.Get_attr(MPI.TAG_UB)) + 1) // (slots + 1)
            base = (serial % span) * (slots + 1)
        else:
            self.comm = check.Dup() if self.own else check
        self.rank, self.size = self.comm.Get_rank(), size
        self.slots = [Slot(self.comm, base + i, self.direct) for i in range(slots)]
        self.left_tag = base + slots
        self.notices: dict[int, tuple[int, int]] = {}  # rank -> (steps handed out, posted)
        self._MPI = MPI

    def check_left(self, step: int) -> None:
        """Raises :class:`Left` if a rank left the join before posting step ``step``."""
        if self.size == 1:
            return
        status = self._MPI.Status()
        while self.comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=self.left_tag, status=status):
            notice = np.zeros(2, np.int64)
            self.comm.Recv(notice, source=status.Get_source(), tag=self.left_tag)
            self.notices[status.Get_source()] = (int(notice[0]), int(notice[1]))
        for rank, (steps, posted) in sorted(self.notices.items()):
            if step > posted:
                raise Left(rank, steps)

    def close(self) -> None:
        """The join's end on every rank (nothing in flight): lets go of everything."""
        for slot in self.slots:
            slot.free()
        if self.own:
            self.comm.Free()

    def leave(self, steps: int, posted: int, *, finalizer: bool = False) -> None:
        """This rank leaves the join before its end, after ``steps`` steps, its bytes posted
        up to step ``posted``: tells every other rank, and gives up on the bytes in flight.
        From a ``finalizer`` run on another thread than the main one (the garbage collector
        runs where it happens to be), at the next join's start instead; after MPI's end, not
        at all (no rank is left to tell)."""
        from mpi4py import MPI

        if not MPI.Is_initialized() or MPI.Is_finalized():
            return
        if finalizer and threading.current_thread() is not threading.main_thread():
            _later.append((self, steps, posted))
            return
        self._leave(steps, posted)

    def _leave(self, steps: int, posted: int) -> None:
        if self.size > 1:
            notice = np.array([steps, posted], np.int64)
            for rank in range(self.size):
                if rank != self.rank:
                    request = self.comm.Isend(notice, dest=rank, tag=self.left_tag)
                    _leftovers.append((request, notice))
        for slot in self.slots:  # those not in flight are done already
            if slot.cancel():
                slot.free()
            else:
                _leftovers.append((slot, slot.send))


def settle() -> None:
    """Leaves the joins dropped where MPI could not be called, and lets go of what the
    joins left in flight that has completed since."""
    while _later:
        wire, steps, posted = _later.pop()
        wire._leave(steps, posted)
    kept = []
    for item, keep in _leftovers:
        if isinstance(item, Slot):
            done = item.cancel()
            if done:
                item.free()
        else:
            done = item.Test()
        if not done:
            kept.append((item, keep))
    _leftovers[:] = kept
