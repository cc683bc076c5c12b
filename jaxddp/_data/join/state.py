"""The state of a :class:`~jaxddp.JoinedStream`: saved by every rank, resumed on as many."""

from __future__ import annotations

from typing import Any

from . import meeting
from .wire import next_serial

__all__ = ["STATE_VERSION", "StateMixin", "get_state"]

STATE_VERSION = 1


def get_state(iterator: Any) -> Any:
    """A stream's own state (grain's ``DatasetIterator.get_state()``), None without one."""
    get = getattr(iterator, "get_state", None)
    return get() if callable(get) and hasattr(iterator, "set_state") else None


class StateMixin:
    """:meth:`state_dict` and :meth:`load_state_dict` of a JoinedStream."""

    _check: Any
    _size: int
    _rank: int
    _started: bool
    _steps: int
    _taken: int
    _ended: bool
    _stream_over: bool
    _batch_size: int | None
    _loaded: dict[str, Any] | None
    _ahead: Any
    _serial: int
    _last_state: Any

    def _open(self) -> Any:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Where every rank's stream is, after the batches handed out so far. A collective.

        A dict, identical on every rank (so the rank that writes a checkpoint holds all of
        it): ``world_size``, ``steps``, ``batch_size`` (0 before the first step) and
        ``ranks``, one entry per rank: ``taken`` (the real batches of its stream handed out),
        ``ended`` (whether its stream had ended) and, for a stream with a state of its own
        (grain's ``DatasetIterator.get_state()``), ``stream``: its state after the batches
        handed out, not after those read ahead (at its end, once it has ended: the state
        has one structure all along, so a fresh join's ``state_dict()`` is a checkpoint's
        target for it). Call it on every rank: a rank whose others do not call it (a save
        under ``if rank == 0:``) raises TimeoutError naming them within
        ``JAXDDP_CHECK_TIMEOUT`` seconds (half ``JAXDDP_STALL_ABORT`` at most).
        """
        mine: dict[str, Any] = {"taken": self._taken, "ended": self._ended}
        if not self._started:
            stream = get_state(self._open())
        else:
            stream = self._ahead[0].state if self._ahead else None
        if stream is not None:  # at its end too: one structure, whatever the step
            mine["stream"] = stream
        serial = self._serial if self._started else next_serial(self._check)
        ranks = meeting.gather(
            self._check,
            mine,
            stamp=(serial, self._steps),
            call="`state_dict()` of `jaxddp.join`",
        )
        return {
            "version": STATE_VERSION,
            "world_size": self._size,
            "steps": self._steps,
            "batch_size": self._batch_size or 0,
            "ranks": ranks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes where :meth:`state_dict` was taken: the next step is the one after it.

        Call it on every rank, with the same state, before the first step. A stream with a
        state of its own (grain) continues from it; any other stream is read again from
        its start and the batches already taken are dropped, so it must yield the same
        batches again (a deterministic stream, reopened). Padding rows, which count for
        nothing, may hold other rows than in the run that saved the state.

        Raises:
          ValueError: if the state comes from another number of ranks (each rank's stream
            is its own: it cannot be divided among more ranks or merged into fewer), or from
            another batch size, or is not a state of :func:`jaxddp.join`.
          RuntimeError: if the stream has already started.
        """
        if self._started:
            msg = (
                "Expected `load_state_dict` before the first step of `jaxddp.join`, got it "
                f"after {self._steps} steps. Load the state into a new `jaxddp.join(...)`."
            )
            raise RuntimeError(msg)
        keys = {"world_size", "steps", "batch_size", "ranks"}
        if not isinstance(state, dict) or not keys <= set(state):
            msg = (
                f"Expected a state from `JoinedStream.state_dict()` (a dict with {sorted(keys)}"
                f"), got {state!r} instead."
            )
            raise ValueError(msg)
        saved = int(state["world_size"])
        if saved != self._size or len(state["ranks"]) != saved:
            msg = (
                f"Expected a state saved on {self._size} ranks, as this job has, got one saved "
                f"on {saved} ranks instead: each rank's stream belongs to its rank (its own "
                "files, filters, packing), so its position cannot be divided among more ranks "
                f"or merged into fewer. Resume on {saved} ranks, or start the streams anew."
            )
            raise ValueError(msg)
        batch_size = int(state["batch_size"]) or None
        if batch_size and self._batch_size and batch_size != self._batch_size:
            msg = (
                f"Expected `batch_size={batch_size}` as in the saved state, got "
                f"`batch_size={self._batch_size}` instead: the steps would not be the same."
            )
            raise ValueError(msg)
        self._batch_size = self._batch_size or batch_size
        self._loaded = dict(state["ranks"][self._rank])
        self._steps = int(state["steps"])

    def _resume(self, mine: dict[str, Any]) -> None:
        """Puts this rank's stream where the state says: its own state, or replayed."""
        self._taken = int(mine["taken"])
        self._ended = bool(mine["ended"])
        if self._ended:
            self._stream_over, self._last_state = True, mine.get("stream")
            return
        iterator = self._open()
        if "stream" in mine and hasattr(iterator, "set_state"):
            iterator.set_state(mine["stream"])
            return
        for done in range(self._taken):
            try:
                next(iterator)
            except StopIteration:
                msg = (
                    f"Expected this rank's stream to yield the {self._taken} batches it had "
                    f"handed out when the state was saved, got only {done} instead: a stream "
                    "without a state of its own must yield the same batches again."
                )
                raise ValueError(msg) from None
