"""The steps of :func:`jaxddp.join`: what each rank says, when, and what it yields.

Ranks talk twice. At the first step, one gather of every rank's batch structure, its first
batch's size and whether it has one fixes the batch size and the structure (or raises the
same error on every rank), and the serial of the join's own channel (:mod:`.wire`). Then
one byte per rank per step, "I have a batch / my stream ended / my stream failed", on that
channel. A step's byte is posted when its batch is read, :data:`DEPTH` hand-outs before the
step, and its request is only completed when that step is asked for: by then every rank has
long posted it and MPI has moved it along at each hand-out since, so waiting for it costs a
look, not a meeting of the ranks (the training step's own allreduce already keeps them in
step). Reading :data:`DEPTH` batches ahead is the price: a stream's state is taken before
each read, so that a saved state counts the batches handed out, not those read ahead, and
what is read is copied (:func:`.batches.own`), since the stream may change it meanwhile.
Whatever reading raises is kept and raised at its own step on every rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from ..._base import progress as _progress
from ..._collectives.consistency import TreeMismatchError, gather_with_deadline
from ..._runtime import world as _world
from .batches import Batch, StreamError, describe_difference, flatten, fresh
from .ends import EndsMixin
from .state import StateMixin, get_state
from .wire import BATCH, ENDED, FAILED, Left, Slot, Wire, error_payload, next_serial, wait

__all__ = ["DEPTH", "JoinedStream"]

DEPTH = 3  # steps read ahead, whose bytes are in flight


class _Ahead(NamedTuple):
    """A step read ahead: its batch (None: the stream had ended), what reading it raised
    (``reading``: while making arrays of the stream's item, not in the stream), and the
    stream's own state before it was read."""

    batch: Batch | None
    problem: BaseException | None
    state: Any
    reading: bool = False

    @property
    def status(self) -> int:
        if self.problem is not None:
            return FAILED
        return ENDED if self.batch is None else BATCH


class JoinedStream(StateMixin, EndsMixin, Iterator[tuple[Any, np.ndarray]]):
    """What :func:`jaxddp.join` returns: this rank's ``(batch, mask)`` pairs, as many on
    every rank. An iterator over one pass of the stream; :meth:`state_dict` (collective)
    and :meth:`load_state_dict` resume it mid-stream on the same number of ranks;
    :meth:`close` leaves it before its end."""

    def __init__(
        self,
        iterable: Iterable[Any],
        *,
        batch_size: int | None = None,
        comm: Any = None,
        masked: bool | None = None,
    ) -> None:
        if batch_size is not None and (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, int | np.integer)
            or batch_size < 1
        ):
            msg = f"Expected `batch_size` to be a positive integer or None, got {batch_size!r}."
            raise ValueError(msg)
        self._source = iterable
        self._batch_size = None if batch_size is None else int(batch_size)
        # jaxddp's own loaders yield (batch, mask) pairs
        self._masked = bool(
            getattr(iterable, "_jaxddp_masked", False) if masked is None else masked
        )
        self._check = _world.check_comm(comm)
        self._size, self._rank = self._check.Get_size(), self._check.Get_rank()
        self._iterator: Iterator[Any] | None = None
        self._stateful = False  # whether the stream has a state of its own (grain's)
        self._last_state: Any = None  # its state at its end, once it has ended
        self._started = self._finished = self._stream_over = False
        self._steps = 0  # steps handed out
        self._taken = 0  # real batches of this rank's stream handed out
        self._ended = False  # whether this rank yielded padding because its stream ended
        self._loaded: dict[str, Any] | None = None
        self._ahead: deque[_Ahead] = deque()  # steps steps+1, steps+2, ... read ahead
        self._flags: deque[Slot] = deque()  # their bytes in flight, oldest first
        self._wire: Wire | None = None  # this join's channel, from the first step on
        self._serial = 0  # the serial the ranks agreed on at the first step
        self._reads = 0
        self._agreed: tuple[Any, Any] | None = None  # the treedef and leaf kinds
        self._description: tuple[str, list[Any]] | None = None
        self._filler: list[Any] | None = None  # a batch of our own, copied for padding
        self._full = self._empty = np.zeros(0, np.bool_)

    @property
    def steps(self) -> int:
        """The steps handed out so far (every rank's count is the same)."""
        return self._steps

    @property
    def batch_size(self) -> int | None:
        """The leading size of every yielded batch, once the first step agreed on it."""
        return self._batch_size

    # -- reading ahead ---------------------------------------------------------------------

    def _open(self) -> Iterator[Any]:
        if self._iterator is None:
            self._iterator = iter(self._source)
            self._stateful = get_state(self._iterator) is not None
        return self._iterator

    def _read(self) -> _Ahead:
        """Reads this rank's batch of the next step not yet read. Whatever raises (the
        stream, or making arrays of what it yielded) is kept, to be raised at its step on
        every rank."""
        if self._stream_over:
            return _Ahead(None, None, self._last_state)
        iterator = self._open()
        state = None
        try:
            state = get_state(iterator) if self._stateful else None
            item = next(iterator)
        except StopIteration:
            self._stream_over, self._last_state = True, state
            return _Ahead(None, None, state)
        except Exception as exc:  # noqa: BLE001 - raised on every rank at its step: see _raise
            self._stream_over, self._last_state = True, state
            return _Ahead(None, exc, state)
        try:
            batch = flatten(item, self._masked)
            if self._agreed is not None:
                self._fits(batch, self._steps + len(self._ahead) + 1)
        except Exception as exc:  # noqa: BLE001 - a leaf that cannot convert, a misfit: as above
            self._stream_over = True
            return _Ahead(None, exc, state, reading=not isinstance(exc, StreamError))
        return _Ahead(batch, None, state)

    def _fits(self, batch: Batch, step: int) -> None:
        """Raises a :class:`StreamError` unless ``batch`` fits what the ranks agreed."""
        assert self._agreed is not None
        assert self._description is not None
        treedef, kinds = self._agreed
        if batch.treedef != treedef or batch.kinds() != kinds:
            text = describe_difference(
                self._rank, batch.describe(), self._description, "the first step"
            )
            raise StreamError(
                TreeMismatchError,
                f"Batch {step} of `jaxddp.join` differs from the structure every rank agreed "
                f"on at its first step: {text}. Every rank's stream must yield batches of one "
                "structure, dtypes and trailing shapes.",
            )
        if batch.rows > (self._batch_size or 0):
            raise StreamError(ValueError, self._too_large(self._rank, batch.rows))

    def _too_large(self, rank: int, rows: int) -> str:
        return (
            f"Expected batches of at most `batch_size={self._batch_size}` rows from every "
            f"rank's stream, got {rows} rows from rank {rank} instead. Pass a larger "
            "`batch_size` to `jaxddp.join`, or make the stream's batches smaller."
        )

    def _fill(self) -> None:
        """Reads ahead to :data:`DEPTH` steps, posting each one's byte as it is read."""
        while len(self._ahead) < DEPTH:
            ahead = self._read()
            self._ahead.append(ahead)
            self._reads += 1
            assert self._wire is not None
            slot = self._wire.slots[self._reads % len(self._wire.slots)]  # at most DEPTH in flight
            slot.start(ahead.status)
            self._flags.append(slot)
        self._flags[0].test()  # moves every byte in flight along (MPI progresses in its calls)

    # -- the steps -------------------------------------------------------------------------

    def __iter__(self) -> JoinedStream:
        return self

    def __next__(self) -> tuple[Any, np.ndarray]:
        if self._finished:
            raise StopIteration
        if self._started:
            assert self._wire is not None
            slot = self._flags[0]
            try:  # returns at its first look where the bytes are there (most steps)
                wait(slot, self._wire, self._steps + 1)
            except Left as left:
                self._left(left)
            self._flags.popleft()
            statuses = slot.statuses.tobytes()
        else:
            statuses = self._start()
        if FAILED in statuses:
            self._raise()
        if not any(statuses):  # every rank's stream ended: the same step on every rank
            self._finish()
            raise StopIteration
        out = self._hand_out(self._ahead.popleft())
        self._fill()
        return out

    def _hand_out(self, ahead: _Ahead) -> tuple[Any, np.ndarray]:
        B = self._batch_size
        assert B is not None
        assert self._agreed is not None
        batch = ahead.batch
        if batch is None:  # this rank's stream ended: a full batch of padding
            assert self._filler is not None
            self._ended = True  # never an array yielded before: a step may have donated it
            leaves, mask = fresh(self._filler), self._empty
        else:
            self._taken += 1
            leaves = batch.padded(B)
            if self._filler is None:  # padding, should this rank's stream end first
                self._filler = fresh(leaves)
            if batch.rows == B:
                mask = self._full if batch.mask is None else batch.mask
            else:
                mask = np.zeros(B, np.bool_)
                mask[: batch.rows] = True if batch.mask is None else batch.mask
        self._steps += 1
        _progress.note("jaxddp.join")
        return jax.tree_util.tree_unflatten(self._agreed[0], leaves), mask

    # -- the first step --------------------------------------------------------------------

    def _start(self) -> bytes:
        """The first step's agreement: one gather of every rank's structure, batch size and
        status; the batch size and the structure are fixed from here on."""
        self._started = True
        first = None
        if self._loaded is not None:
            try:
                self._resume(self._loaded)
            except ValueError as exc:  # raised on every rank, as a stream's failure
                self._stream_over = True
                first = _Ahead(None, StreamError(ValueError, str(exc)), None)
        first = first or self._read()
        self._ahead.append(first)
        batch = first.batch
        mine = (
            first.status,
            None if batch is None else batch.rows,
            None if batch is None else batch.describe(),
            self._batch_size,
            self._steps,
            None if first.problem is None else error_payload(first.problem, first.reading),
            next_serial(self._check),
        )
        everyone = [mine]
        if self._size > 1:
            everyone = gather_with_deadline(
                self._check, mine, what="first batches of `jaxddp.join`", error=TimeoutError
            )
        # the join's own channel: its serial, the highest proposed, on every rank (whatever
        # an earlier join left in flight travels on another's)
        self._serial = max(e[6] for e in everyone)
        self._wire = Wire(self._check, self._serial, DEPTH + 1)
        statuses = bytes(e[0] for e in everyone)
        if FAILED in statuses:
            self._raise([e[5] for e in everyone])
        try:
            self._agree(everyone)
        except Exception:  # the same error on every rank, at the same point
            self._finished = True
            self._drain()
            raise
        return statuses

    def _agree(self, everyone: list[tuple[Any, ...]]) -> None:
        """Fixes the batch size and the structure, or raises the same error on every rank."""
        for index, name, fix in (
            (3, "pass the same `batch_size` to", ""),
            (4, "resume at the same step of", " Load one saved `state_dict()` on every rank."),
        ):
            if len({e[index] for e in everyone}) > 1:
                per_rank = ", ".join(f"rank {r}: {e[index]}" for r, e in enumerate(everyone))
                msg = f"Expected every rank to {name} `jaxddp.join`, got {per_rank} instead.{fix}"
                raise ValueError(msg)
        holders = [r for r, e in enumerate(everyone) if e[0] == BATCH]
        if not holders:
            return  # nothing to yield on any rank
        if self._batch_size is None:
            self._batch_size = max(everyone[r][1] for r in holders)
            if self._batch_size == 0:
                msg = (
                    "Expected a first batch with at least one row on some rank, got empty "
                    "first batches on every rank instead: `jaxddp.join` takes the batch size "
                    "from them. Pass `batch_size`."
                )
                raise ValueError(msg)
        for r in holders:
            if everyone[r][1] > self._batch_size:
                raise ValueError(self._too_large(r, everyone[r][1]))
        first = holders[0]
        agreed = self._description = everyone[first][2]
        for r in holders[1:]:
            if everyone[r][2] != agreed:
                text = describe_difference(r, everyone[r][2], agreed, f"rank {first}'s")
                msg = (
                    f"The first batches of `jaxddp.join` differ across ranks: {text}. Every "
                    "rank's stream must yield batches of one structure, dtypes and trailing "
                    "shapes, or the ranks' steps call different collectives."
                )
                raise TreeMismatchError(msg)
        B = self._batch_size
        assert B is not None
        self._full = _read_only(np.ones(B, np.bool_))
        self._empty = _read_only(np.zeros(B, np.bool_))
        mine = self._ahead[0].batch
        if mine is not None:
            self._agreed = (mine.treedef, mine.kinds())
        if len(holders) < self._size:  # some rank has nothing: it pads with first's batch
            self._share_filler(first, mine)

    def _share_filler(self, root: int, mine: Batch | None) -> None:
        """The first rank with data sends its first batch, padded to the batch size, to
        every rank (once): what a rank without data yields as padding."""
        payload = None
        if self._rank == root:
            assert mine is not None
            leaves = [np.asarray(x) for x in mine.padded(self._batch_size or 0)]
            payload = jax.tree_util.tree_unflatten(mine.treedef, leaves)
        leaves, treedef = jax.tree_util.tree_flatten(self._check.bcast(payload, root=root))
        if mine is None:
            self._agreed = (treedef, tuple((x.dtype, x.shape[1:]) for x in leaves))
            self._filler = leaves

    def __repr__(self) -> str:
        return f"jaxddp.join({self._source!r}, batch_size={self._batch_size}) at step {self._steps}"


def _read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array
