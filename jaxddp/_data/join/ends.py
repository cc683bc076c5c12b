"""How a :class:`~jaxddp.JoinedStream` ends: at the step where every rank's stream has
ended (the bytes in flight completed, the channel let go); at a failure, raised on every
rank at its step; or left early by this rank (``close()``, or the join dropped by a
``break``), or by another rank while this one waits for it."""

from __future__ import annotations

from collections import deque
from typing import Any

from .batches import StreamError
from .wire import KINDS, Left, Slot, Wire, error_payload, wait

__all__ = ["EndsMixin"]


class EndsMixin:
    """The ends of a JoinedStream."""

    _check: Any
    _size: int
    _steps: int
    _finished: bool
    _ended: bool
    _iterator: Any
    _wire: Wire | None
    _flags: deque[Slot]
    _ahead: Any

    # -- at the step where every rank's stream has ended ---------------------------------

    def _drain(self) -> None:
        """Completes every byte in flight (every rank has posted as many), and lets go of
        the join's channel."""
        wire, self._wire = self._wire, None
        while self._flags:
            assert wire is not None
            wait(self._flags.popleft(), wire, self._steps + 1)
        if wire is not None:
            wire.close()

    def _finish(self) -> None:
        self._finished = self._ended = True  # a state saved now has nothing left to read
        self._drain()
        self._close_stream()

    def _close_stream(self) -> None:
        close = getattr(self._iterator, "close", None)
        if callable(close):  # let go of the stream's files and workers
            close()

    # -- left early ----------------------------------------------------------------------

    def close(self) -> None:
        """Leaves the join before its end: no more steps here. The other ranks should leave
        it at the same step (a ``break`` on a condition every rank shares): a rank still
        iterating raises an error naming this one where it would wait for its bytes. A loop
        left with ``break`` drops the join, which then does the same. Closes the stream if
        it has a ``close`` method; a join at its end needs no call."""
        if self._finished:
            return
        self._finished = True
        self._leave()
        self._close_stream()

    def _leave(self, *, finalizer: bool = False) -> None:
        """Tells the other ranks how far this rank's bytes go, and gives up on them."""
        wire, self._wire = self._wire, None
        self._flags.clear()
        if wire is not None:
            wire.leave(self._steps, self._steps + len(self._ahead), finalizer=finalizer)

    def _left(self, left: Left) -> None:
        """Another rank left the join before the step this rank waits for."""
        steps = self._steps
        self._finished = True
        self._leave()
        msg = (
            f"Rank {left.rank} left this `jaxddp.join` after step {left.steps} (its loop ended "
            f"there: a `break`, an exception, or `close()`), and this rank, at step "
            f"{steps + 1}, would wait for it forever: the ranks' loops over one join must end "
            "at the same step. Leave it on a condition every rank shares (a number of steps, "
            "a value from an allreduce), or iterate it to its end: its steps end on every "
            "rank at once."
        )
        raise RuntimeError(msg)

    def __del__(self) -> None:
        # A loop left early (a `break`) drops the join with bytes in flight: the other ranks
        # learn how far this rank's go, and its receives are cancelled.
        if getattr(self, "_wire", None) is not None and not self._finished:
            self._finished = True
            try:  # noqa: SIM105 - at the interpreter's exit, contextlib may be gone already
                self._leave(finalizer=True)
            except Exception:  # noqa: BLE001, S110 - a finalizer never raises
                pass

    # -- a failure, raised on every rank -------------------------------------------------

    def _raise(self, payloads: list[Any] | None = None) -> None:
        """Every rank raises at the step where some rank's stream failed: that rank its own
        exception, the others the same type for jaxddp's checks, else a RuntimeError."""
        self._finished = True
        first = self._ahead[0] if self._ahead else None
        problem = None if first is None else first.problem
        self._drain()  # every byte in flight: every rank posted as many
        if payloads is None:  # every rank saw the failure at this step: all gather
            assert first is not None
            mine = None if problem is None else error_payload(problem, first.reading)
            payloads = self._check.allgather(mine) if self._size > 1 else [mine]
        assert payloads is not None
        if problem is not None:
            if isinstance(problem, StreamError):
                raise problem.kind(str(problem))
            raise problem
        rank, (kind, text, ours, reading) = next(
            (r, p) for r, p in enumerate(payloads) if p is not None
        )
        if ours:
            raise KINDS[kind](text)
        step = self._steps + 1
        what = f"batch {step} could not be read: {kind}: " if reading else f"stream raised {kind}: "
        msg = (
            f"Rank {rank}'s {what}{text} (at step {step} of `jaxddp.join`). Every rank stops "
            "here, so that none waits for it forever."
        )
        raise RuntimeError(msg)
