"""The watchdog thread: progress to rank 0 once a second, rank 0 decides when to report
and when to abort; at exit, every rank waits for all to reach theirs.

Rank 0's thread also tells rank 1 (its deputy) once a tick that it is alive. A rank 0 whose
Python threads cannot run (its main thread blocked in C code that holds the GIL, a stopped
process) tells nothing: once rank 1 has not heard from it for ``JAXDDP_STALL_WARN`` seconds
plus the time a report may take, and has made no progress itself, rank 1 reports (rank 0 as
not answering) and, after ``JAXDDP_STALL_ABORT`` seconds, aborts the job itself.

Before any jaxddp abort (:func:`abort_job`: a stall, an uncaught exception, a failing
``sys.exit``) the aborting rank writes its line and flushes, asks every rank's watchdog to
hold its stdout and stderr (what was printed is written, later writes wait until the abort
ends the rank) and to wait until the launcher has read them, waits a moment for their
answers, then holds its own and waits for the launcher to have read it, so that what each
rank printed reaches the job's output before ``MPI_Abort`` kills it, even from a rank that
prints all the while (:mod:`jaxddp._base.streams`).
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from types import ModuleType
from typing import Any

import numpy as np

from ..._base import exit as _exit
from ..._base import progress as _progress
from ..._base import settings as _settings
from ..._base import streams as _streams
from ..._types import Communicator
from .report import render
from .sleeps import MainSleeps
from .stacks import SHOWN_FRAMES, folded_stack

_TAG_STATUS, _TAG_REQUEST, _TAG_REPORT = 7301, 7302, 7303
_TAG_ALIVE, _TAG_FLUSH, _TAG_FLUSHED = 7304, 7305, 7306
DEPUTY = 1  # the rank that watches rank 0's watchdog, and stands in for it
NAP = 0.1  # seconds between two looks for a flush request
FLUSH_GRACE = 1.0  # seconds an aborting rank waits for the others to have flushed
READ_GRACE = 0.5  # seconds a rank waits for the launcher to have read what it flushed


def abort_job(status: int, line: str) -> None:
    """Ends the whole job with ``MPI_Abort(status)``, its output kept: writes ``line`` to
    stderr and flushes, asks every other rank to hold its own and wait until the launcher
    has read it (through the watchdog, whose thread answers even while the main thread waits
    in MPI), waits at most :data:`FLUSH_GRACE` seconds for their answers, then holds its own
    output and waits at most :data:`READ_GRACE` seconds for the launcher to have read it:
    MPICH's hydra drops what is still in a rank's pipe when the abort reaches it. Its
    stderr is given back just before ``MPI_Abort``, which writes its own line there."""
    global _aborting
    _aborting = True  # this rank answers others' requests without holding its output
    with contextlib.suppress(Exception):
        sys.stderr.write(line)
    _streams.flush()
    dog = _watchdog
    if isinstance(dog, _Watchdog):
        with contextlib.suppress(Exception):
            dog.flush_everyone(FLUSH_GRACE)
    with contextlib.suppress(Exception):
        _streams.hold()  # what the other threads printed meanwhile is written, no more
    _streams.wait_until_read(READ_GRACE)
    with contextlib.suppress(Exception):
        _streams.release((2,))
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(status)


_aborting = False  # whether this rank is in abort_job


# -- the watchdog thread ------------------------------------------------------------------


_watchdog: _Watchdog | _Off | None = None


def start(MPI: ModuleType) -> None:
    """Starts the stall inspector on every rank, once; call it on the main thread of every
    rank (it duplicates ``COMM_WORLD``, a collective), after ``MPI_Init``."""
    global _watchdog
    if _watchdog is not None:
        return
    warn, abort = _settings.stall_warn(), _settings.stall_abort()
    world = MPI.COMM_WORLD
    if warn == 0 or world.Get_size() == 1 or MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        _watchdog = _Off()
        return
    _exit.install()
    _watchdog = _Watchdog(MPI, world.Dup(), warn, abort)
    _watchdog.thread.start()
    atexit.register(_watchdog.at_exit)


class _Off:
    """The watchdog when it is off (``JAXDDP_STALL_WARN=0``, a world of one)."""


class _Watchdog:
    def __init__(
        self, MPI: ModuleType, comm: Communicator, warn: float, abort: float | None
    ) -> None:
        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.warn, self.abort = warn, abort
        self.tick = min(1.0, warn / 5)
        self.answer_within = max(2.0, min(5.0, warn / 2))
        self.main = threading.main_thread().ident
        self.exiting = threading.Event()
        self.done = threading.Event()
        self.exited_at: float | None = None
        self.seen, self.changed = -1, time.monotonic()
        self.where: list[tuple[Any, int]] = []
        self.moves = 0
        self.main_sleeps = MainSleeps(threading.main_thread().native_id)
        self.sleeps, self.talked_at = self.main_sleeps.count(), time.monotonic()
        self.sends: list[Any] = []
        self.thread = threading.Thread(target=self._run, name="jaxddp-watchdog", daemon=True)
        # rank 0's view of every rank
        self.counts = np.zeros(self.size, np.int64)
        self.exited = np.zeros(self.size, bool)
        self.heard = np.full(self.size, time.monotonic())
        self.status_in: list[tuple[Any, Any]] = []
        self.last_total: tuple[int, int] = (-1, -1)
        self.progress_at = time.monotonic()
        self.reported_at: float | None = None
        self.seq = 0
        # rank 1's view of rank 0's watchdog
        self.lead_heard = time.monotonic()
        self.alive = np.zeros(1, np.int64)
        self.deputy_reported: float | None = None
        self.flush_token = np.zeros(1, np.int64)
        self._alive_send: Any = None
        self._keep_flush: Any = None

    # the main thread, at exit
    def at_exit(self) -> None:
        """Keeps answering until every rank has reached its exit; then lets MPI finalize.
        Flushes first: another rank may abort the job while this one waits here."""
        _streams.flush()
        self.exited_at = time.monotonic()
        self.exiting.set()
        while self.thread.is_alive() and not self.done.wait(0.1):
            pass

    # the thread
    def _run(self) -> None:
        barrier = None
        if self.rank == 0:
            self._post_status_receives()
        broken = False
        while True:
            if self.exiting.is_set() and barrier is None:
                barrier = self.comm.Ibarrier()
            if barrier is not None and barrier.Test():
                break
            if not broken:
                try:
                    self._step()
                except Exception as exc:  # noqa: BLE001 - the inspector must never end the job
                    broken = True
                    sys.stderr.write(f"jaxddp: the stall inspector stopped: {exc!r}\n")
            self._nap(self.tick)
        for request, _ in self.status_in:
            with contextlib.suppress(Exception):
                request.Cancel()
                request.Wait()
        self.done.set()

    def _nap(self, seconds: float) -> None:
        """Sleeps ``seconds``, looking every :data:`NAP` s for another rank's request to flush."""
        end = time.monotonic() + seconds
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(NAP, left))
            before = self.main_sleeps.count()
            try:
                self._answer_flush()
            except Exception:  # noqa: BLE001 - never let a flush end the inspector
                return
            finally:
                # the main thread's sleeps while this thread held MPI's lock: not progress
                self.sleeps += self.main_sleeps.count() - before

    def _answer_flush(self) -> None:
        status = self.MPI.Status()
        while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=_TAG_FLUSH, status=status):
            source = status.Get_source()
            self.comm.Recv(self.flush_token, source=source, tag=_TAG_FLUSH)
            if _aborting:  # this rank's own abort holds its output, and must write its line
                _streams.flush()
            else:  # what was printed is written; later writes wait for the abort
                _streams.hold(limit=_streams.HOLD_LIMIT)
            _streams.wait_until_read(READ_GRACE)  # before the answer that lets it abort
            self.sends.append(self.comm.Isend(self.flush_token, dest=source, tag=_TAG_FLUSHED))

    def flush_everyone(self, grace: float) -> None:
        """Asks every other rank's watchdog to flush its stdout and stderr; waits at most
        ``grace`` seconds for every answer. Callable from any thread."""
        others = [r for r in range(self.size) if r != self.rank]
        token = np.zeros(1, np.int64)
        sent = [self.comm.Isend(token, dest=r, tag=_TAG_FLUSH) for r in others]
        answers = [np.zeros(1, np.int64) for _ in others]
        acks = [
            self.comm.Irecv(b, source=r, tag=_TAG_FLUSHED)
            for r, b in zip(others, answers, strict=True)
        ]
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self.MPI.Request.Testall(acks):
            time.sleep(0.005)
        self._keep_flush = (sent, token, acks, answers)  # MPI may still use them

    def _moved(self) -> int:
        """Progress seen from outside, for loops that call no jaxddp function from Python
        (a jitted step's collectives run in compiled code). Counted once per tick in which
        the main thread is somewhere else than a tick before, is compiling (XLA's compiler
        is one long call, the same on every rank), or has slept and woken again since this
        thread last talked (it waited for a step's result, and the result came). A thread
        blocked in a collective does none of these: it sleeps once and for good (waiting for
        a compiled step, or asleep in the user's code), or spins in MPI in one call, where
        it sleeps only while this thread holds MPI's lock, or sleeps in short turns in an MPI
        that sleeps while it polls (:meth:`MainSleeps.polling`: not progress)."""
        if self.exiting.is_set():  # the main thread polls in at_exit: not progress
            return self.moves
        frame = None if self.main is None else sys._current_frames().get(self.main)
        where, compiling = [], False
        while frame is not None:
            where.append((frame.f_code, frame.f_lasti))
            compiling = compiling or frame.f_code.co_name.startswith("backend_compile")
            frame = frame.f_back
        wakes = self.main_sleeps.count() - self.sleeps  # since this thread last talked
        woke = wakes > 0
        if woke and not compiling and where == self.where:
            woke = not self.main_sleeps.polling(wakes, time.monotonic() - self.talked_at)
        if compiling or woke or where != self.where:
            self.where = where
            self.moves += 1
        return self.moves

    def _step(self) -> None:
        try:
            self._talk()
        finally:
            # The main thread also sleeps when it waits for MPI's lock while this thread
            # talks (a collective spinning in MPI): those sleeps are not progress.
            self.sleeps, self.talked_at = self.main_sleeps.count(), time.monotonic()

    def _talk(self) -> None:
        now = time.monotonic()
        count = _progress.count + self._moved()
        if count != self.seen:
            self.seen, self.changed = count, now
        self.sends = [r for r in self.sends if not r.Test()]
        if self.rank == 0:
            self._lead(now)
            return
        if not self.sends:
            status = np.array([count, self.exiting.is_set()], np.int64)
            self.sends.append(self.comm.Isend(status, dest=0, tag=_TAG_STATUS))
            self._keep = status
        self._answer_requests()
        if self.rank == DEPUTY:
            self._deputize(now)

    def _answer_requests(self) -> None:
        """Answers a report's request (from rank 0, or from the deputy standing in for it)."""
        status = self.MPI.Status()
        while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=_TAG_REQUEST, status=status):
            seq, requester = self.comm.recv(source=status.Get_source(), tag=_TAG_REQUEST)
            snapshot = self.snapshot(seq)
            self.sends.append(self.comm.isend(snapshot, dest=requester, tag=_TAG_REPORT))

    def _deputize(self, now: float) -> None:
        """Rank 1: reports, and aborts, in rank 0's stead when rank 0's watchdog is silent
        (its Python threads cannot run) and this rank has made no progress either."""
        while self.comm.Iprobe(source=0, tag=_TAG_ALIVE):
            self.comm.Recv(self.alive, source=0, tag=_TAG_ALIVE)
            self.lead_heard = now
        silent = now - self.lead_heard
        if silent < self.warn + self.answer_within:
            self.deputy_reported = None
            return
        stalled = min(silent, now - self.changed)
        why = (
            f"(reported by rank {self.rank}: rank 0, whose stall inspector leads, has not been "
            f"heard from for {silent:.0f} s)\n"
        )
        if self.abort is not None and stalled >= self.abort:
            text = render(self.gather(), stalled, self.warn, self.abort, aborting=True)
            abort_job(1, text[:-1] + "\n" + why)
        elif stalled >= self.warn and (
            self.deputy_reported is None or now - self.deputy_reported >= self.warn
        ):
            text = render(self.gather(), stalled, self.warn, self.abort, aborting=False)
            self._print(text + why)
            self.deputy_reported = time.monotonic()

    def _post_status_receives(self) -> None:
        for r in range(1, self.size):
            buffer = np.zeros(2, np.int64)
            self.status_in.append((self.comm.Irecv(buffer, source=r, tag=_TAG_STATUS), buffer))

    def _lead(self, now: float) -> None:
        if self.size > DEPUTY and not any(r is self._alive_send for r in self.sends):
            self._alive_send = self.comm.Isend(self.alive, dest=DEPUTY, tag=_TAG_ALIVE)
            self.sends.append(self._alive_send)
        self._answer_requests()
        for r in range(1, self.size):
            request, buffer = self.status_in[r - 1]
            while request.Test():
                self.counts[r], self.exited[r], self.heard[r] = buffer[0], bool(buffer[1]), now
                request = self.comm.Irecv(buffer, source=r, tag=_TAG_STATUS)
                self.status_in[r - 1] = (request, buffer)
        self.counts[0], self.exited[0], self.heard[0] = self.seen, self.exiting.is_set(), now
        total = (int(self.counts.sum()), int(self.exited.sum()))
        if total != self.last_total:
            if self.reported_at is not None:
                sys.stderr.write(
                    f"jaxddp: progress resumed after {now - self.progress_at:.0f} s without.\n"
                )
                self.reported_at = None
            self.last_total, self.progress_at = total, now
            return
        stalled = now - self.progress_at
        if self.abort is not None and stalled >= self.abort:
            abort_job(1, render(self.gather(), stalled, self.warn, self.abort, aborting=True))
        elif stalled >= self.warn and (
            self.reported_at is None or now - self.reported_at >= self.warn
        ):
            self._print(render(self.gather(), stalled, self.warn, self.abort, aborting=False))
            self.reported_at = time.monotonic()

    @staticmethod
    def _print(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    def snapshot(self, seq: int) -> dict[str, Any]:
        """What this rank tells rank 0 for a report."""
        now = time.monotonic()
        frame = None if self.main is None else sys._current_frames().get(self.main)
        user, inner, waiting = folded_stack(frame)
        exited = None
        if self.exited_at is not None:
            code = _exit.status
            how = (
                "reached the end of the program"
                if _exit.where is None
                else (f"called sys.exit({code!r}) at {_exit.where}")
            )
            exited = (now - self.exited_at, how)
        return {
            "seq": seq,
            "rank": self.rank,
            "count": self.seen,
            "events": _progress.count,
            "label": _progress.label,
            "since": now - self.changed,
            "user": user[:SHOWN_FRAMES],
            "inner": inner,
            "waiting": waiting,
            "exited": exited,
        }

    def gather(self) -> dict[int, dict[str, Any] | float]:
        """Every rank's snapshot; for a rank that did not answer in time, the seconds since
        rank 0 last heard from it."""
        self.seq += 1
        seq = self.seq
        for r in range(self.size):
            if r != self.rank:
                self.sends.append(self.comm.isend((seq, self.rank), dest=r, tag=_TAG_REQUEST))
        got: dict[int, dict[str, Any] | float] = {self.rank: self.snapshot(seq)}
        status = self.MPI.Status()
        deadline = time.monotonic() + self.answer_within
        while len(got) < self.size and time.monotonic() < deadline:
            while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=_TAG_REPORT, status=status):
                answer = self.comm.recv(source=status.Get_source(), tag=_TAG_REPORT)
                if answer["seq"] == seq:
                    got[answer["rank"]] = answer
            time.sleep(0.02)
        now = time.monotonic()
        for r in range(self.size):
            if self.rank == 0:
                got.setdefault(r, now - float(self.heard[r]))
            else:  # the deputy hears only rank 0's watchdog
                got.setdefault(r, now - self.lead_heard if r == 0 else float("nan"))
        return got
