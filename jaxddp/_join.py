"""Uneven per-rank streams: every rank takes the same number of fixed-shape steps.

When each rank reads a stream of its own (its own files, a filter, sequence packing, a grain
``IterDataset``, a PyTorch ``IterableDataset``), the ranks' streams end after different
numbers of batches, and the rank that runs out first leaves the loop while the others wait
forever in their next allreduce. :func:`join` wraps a rank's stream and yields
``(batch, mask)`` on every rank until the *last* rank's stream ends: a rank whose stream
ended yields padding-only batches (mask all False), which :func:`jaxddp.masked_mean`,
the gradient average and :class:`jaxddp.SyncBatchNorm` count as nothing.

The ranks talk twice: once at the first step (one gather: the batch structure, the batch
size, which ranks have data), then one byte per rank per step, "I have a batch / my stream
ended / my stream failed", posted as a non-blocking allgather when a batch is handed out
and completed when the next one is asked for, so that it travels while the step computes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from . import _progress, _world
from ._consistency import TreeMismatchError, gather_with_deadline

__all__ = ["JoinedStream", "join"]

# What each rank says of its next batch, one byte per rank per step.
_ENDED, _BATCH, _FAILED = 0, 1, 2
_STATE_VERSION = 1


def join(
    iterable: Iterable[Any],
    *,
    batch_size: int | None = None,
    comm: Any = None,
    masked: bool | None = None,
) -> JoinedStream:
    """Yields this rank's batches as ``(batch, mask)``, on every rank for the same number
    of steps: until the last rank's stream ends.

    Wrap each rank's own stream of batches (pytrees of arrays with a leading batch axis)
    and train on what it yields: every yielded batch has the leading size ``batch_size``,
    so a jitted step compiles once. A short batch is padded by repeating its rows (mask
    False at the padding: real values, so a loss on padding rows stays finite); a rank
    whose stream has ended yields padding-only batches (mask all False) of the same
    structure until every rank's stream has ended; a rank whose stream is empty from the
    start gets a batch to pad with from a rank that has one. With
    :func:`jaxddp.masked_mean` for the loss (and :class:`jaxddp.SyncBatchNorm` for batch
    statistics), step ``k`` trains exactly as one process would on the real samples of
    every rank's ``k``-th batch together.

    A collective over ``comm``: every rank iterates, and the first step checks that every
    rank's batches have the same structure (tree paths, dtypes, trailing shapes), raising
    :class:`jaxddp.TreeMismatchError` on every rank otherwise, before any step runs. A
    stream that raises, or a later batch that is too large or of another structure, raises
    on every rank at that step (the rank's own exception on that rank, an error naming it
    on the others), so no rank is left waiting. Each step counts as progress for the stall
    inspector. Leaves that are not JAX arrays (NumPy arrays, PyTorch CPU tensors, lists)
    are yielded as NumPy arrays; JAX arrays stay JAX arrays.

    Args:
      iterable: this rank's batches: any iterable (a generator, a grain ``IterDataset`` or
        ``DatasetIterator``, a PyTorch ``DataLoader``). Iterated once.
      batch_size: the leading size of every yielded batch; by default the largest of the
        ranks' first batches. A larger batch is an error naming its size.
      comm: an mpi4py communicator whose ranks train together; by default the MPI world.
      masked: whether the stream yields ``(batch, mask)`` pairs whose mask (bool, one
        entry per row) is kept and padded; by default True for jaxddp's own loaders
        (``jaxddp.grain.batches``, ``jaxddp.torch.DataLoader``) and False otherwise.

    Returns:
      A :class:`JoinedStream`: an iterator of ``(batch, mask)`` pairs with
      :meth:`~JoinedStream.state_dict` and :meth:`~JoinedStream.load_state_dict`.

    Example:
      >>> import numpy as np, jaxddp
      >>> stream = (np.arange(n, dtype=np.float32) for n in (4, 4, 3))  # this rank's
      >>> for batch, mask in jaxddp.join(stream):  # on one rank: its own batches
      ...     print(batch.tolist(), mask.tolist())
      [0.0, 1.0, 2.0, 3.0] [True, True, True, True]
      [0.0, 1.0, 2.0, 3.0] [True, True, True, True]
      [0.0, 1.0, 2.0, 0.0] [True, True, True, False]
    """
    return JoinedStream(iterable, batch_size=batch_size, comm=comm, masked=masked)


class _Batch:
    """One batch read from the stream, flattened: its leaves, structure and real rows."""

    __slots__ = ("leaves", "mask", "rows", "treedef")

    def __init__(self, leaves: list[Any], treedef: Any, rows: int, mask: Any) -> None:
        self.leaves, self.treedef, self.rows, self.mask = leaves, treedef, rows, mask

    def kinds(self) -> tuple[tuple[Any, tuple[int, ...]], ...]:
        return tuple((leaf.dtype, tuple(leaf.shape[1:])) for leaf in self.leaves)

    def describe(self) -> tuple[str, list[tuple[str, str]]]:
        """The structure every rank must share, as text: the tree and each leaf's
        ``dtype[*,trailing shape]`` (``*``: the batch axis, which may differ)."""
        paths = _paths(self.treedef)
        kinds = [_kind(dtype, shape) for dtype, shape in self.kinds()]
        return str(self.treedef), list(zip(paths, kinds, strict=True))


def _kind(dtype: Any, shape: tuple[int, ...]) -> str:
    return f"{np.dtype(dtype).name}[{','.join(['*', *map(str, shape)])}]"


def _paths(treedef: Any) -> list[str]:
    dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    flat, _ = jax.tree_util.tree_flatten_with_path(dummy)
    return [jax.tree_util.keystr(path) for path, _ in flat]


class _StreamError(Exception):
    """A problem of this rank's batch that every rank raises, as ``kind``."""

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _as_array(leaf: Any) -> Any:
    return leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)


def _flatten(item: Any, masked: bool) -> _Batch:
    """This rank's item as a :class:`_Batch`, or a :class:`_StreamError` saying why not."""
    mask = None
    if masked:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise _StreamError(
                TypeError,
                f"Expected `(batch, mask)` pairs from the stream (`masked=True`), got a "
                f"{type(item).__name__} instead. Pass `masked=False` for a stream of batches.",
            )
        item, mask = item
    leaves, treedef = jax.tree_util.tree_flatten(item)
    if not leaves:
        raise _StreamError(
            ValueError,
            f"Expected a batch with at least one array, got {item!r} instead: a batch is a "
            "pytree of arrays with a leading batch axis.",
        )
    leaves = [_as_array(leaf) for leaf in leaves]
    rows = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if None in rows or len(rows) > 1:
        shapes = ", ".join(
            f"`{p}` {tuple(leaf.shape)}" for p, leaf in zip(_paths(treedef), leaves, strict=True)
        )
        raise _StreamError(
            ValueError,
            f"Expected every leaf of a batch to have the same leading (batch) axis, got "
            f"{shapes} instead. Give every leaf one row per sample.",
        )
    (n,) = rows
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != (n,):
            raise _StreamError(
                ValueError,
                f"Expected the mask of a `(batch, mask)` pair to be a bool array of shape "
                f"({n},), one entry per row, got {mask.dtype}{list(mask.shape)} instead.",
            )
    return _Batch(leaves, treedef, n, mask)


def _describe_difference(
    rank: int, mine: tuple[str, list[tuple[str, str]]], agreed: tuple[str, list[Any]], other: str
) -> str:
    """``rank``'s batch structure against ``other``'s: the first differing leaf first."""
    (tree, leaves), (agreed_tree, agreed_leaves) = mine, agreed
    theirs = dict(agreed_leaves)
    ours = dict(leaves)
    for path in [p for p, _ in agreed_leaves] + [p for p, _ in leaves]:
        if theirs.get(path) != ours.get(path):
            return (
                f"rank {rank}'s batch has {ours.get(path, 'nothing')} at `{path}` where "
                f"{other} has {theirs.get(path, 'nothing')}"
            )
    return f"rank {rank}'s batch is the tree {tree} where {other} has {agreed_tree}"


class JoinedStream(Iterator[tuple[Any, np.ndarray]]):
    """What :func:`join` returns: this rank's ``(batch, mask)`` pairs, as many on every rank.

    An iterator over one pass of the stream. :meth:`state_dict` (collective) and
    :meth:`load_state_dict` resume it mid-stream on the same number of ranks.
    """

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
        if masked is None:
            masked = _is_jaxddp_loader(iterable)
        self._source = iterable
        self._batch_size = None if batch_size is None else int(batch_size)
        self._masked = bool(masked)
        self._check = _world.check_comm(comm)
        self._size = self._check.Get_size()
        self._rank = self._check.Get_rank()
        self._iterator: Iterator[Any] | None = None
        self._started = self._finished = False
        self._steps = 0  # batches handed out
        self._taken = 0  # real batches of this rank's stream handed out
        self._ended = False  # whether this rank's stream had ended at the last hand-out
        self._stream_state: Any = None  # the stream's own state after the last hand-out
        self._loaded: dict[str, Any] | None = None
        self._next: _Batch | None = None  # read ahead: the batch of the coming step
        self._problem: BaseException | None = None  # what reading it raised
        self._stream_over = False
        self._agreed: tuple[Any, Any] | None = None  # the treedef and leaf kinds
        self._description: tuple[str, list[Any]] | None = None
        self._filler: list[Any] | None = None  # a full-size batch to yield as padding
        self._request: Any = None
        self._send = np.zeros(1, np.int8)
        self._statuses = np.zeros(self._size, np.int8)
        self._full = self._empty = np.zeros(0, np.bool_)

    # -- the stream ------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """The steps handed out so far (every rank's count is the same)."""
        return self._steps

    @property
    def batch_size(self) -> int | None:
        """The leading size of every yielded batch, once the first step agreed on it."""
        return self._batch_size

    def _open(self) -> Iterator[Any]:
        if self._iterator is None:
            self._iterator = iter(self._source)
        return self._iterator

    def _read(self) -> None:
        """Reads this rank's next batch into ``_next`` (None once its stream ended), or
        keeps what reading raised in ``_problem``."""
        self._next = None
        if self._stream_over:
            return
        iterator = self._open()
        self._stream_state = _get_state(iterator)
        try:
            item = next(iterator)
        except StopIteration:
            self._stream_over = True
            return
        except Exception as exc:  # noqa: BLE001 - raised on every rank at this step: see _raise
            self._problem = exc
            return
        try:
            batch = _flatten(item, self._masked)
            if self._agreed is not None:
                self._fits(batch)
        except _StreamError as exc:
            self._problem = exc
            return
        self._next = batch

    def _status(self) -> int:
        if self._problem is not None:
            return _FAILED
        return _ENDED if self._next is None else _BATCH

    def _fits(self, batch: _Batch) -> None:
        """Raises a :class:`_StreamError` unless ``batch`` fits what the ranks agreed."""
        assert self._agreed is not None
        assert self._batch_size is not None
        treedef, kinds = self._agreed
        if batch.treedef != treedef or batch.kinds() != kinds:
            assert self._description is not None
            text = _describe_difference(
                self._rank, batch.describe(), self._description, "the first step"
            )
            raise _StreamError(
                TreeMismatchError,
                f"Batch {self._steps + 1} of `jaxddp.join` differs from the structure every "
                f"rank agreed on at its first step: {text}. Every rank's stream must yield "
                "batches of one structure, dtypes and trailing shapes.",
            )
        if batch.rows > self._batch_size:
            raise _StreamError(ValueError, self._too_large(self._rank, batch.rows))

    def _too_large(self, rank: int, rows: int) -> str:
        return (
            f"Expected batches of at most `batch_size={self._batch_size}` rows from every "
            f"rank's stream, got {rows} rows from rank {rank} instead. Pass a larger "
            "`batch_size` to `jaxddp.join`, or make the stream's batches smaller."
        )

    # -- the steps -------------------------------------------------------------------------

    def __iter__(self) -> JoinedStream:
        return self

    def __next__(self) -> tuple[Any, np.ndarray]:
        if self._finished:
            raise StopIteration
        statuses = self._start() if not self._started else self._wait()
        if not statuses.any():  # every rank's stream ended: the same step on every rank
            self._finish()
            raise StopIteration
        out = self._hand_out()
        self._read()
        self._post()
        return out

    def _wait(self) -> np.ndarray:
        if self._request is not None:
            self._request.Wait()
            self._request = None
        statuses = self._statuses
        if (statuses == _FAILED).any():
            self._raise(statuses)
        return statuses

    def _post(self) -> None:
        self._send[0] = self._status()
        if self._size == 1:
            self._statuses[0] = self._send[0]
            return
        self._request = _wire(self._check).Iallgather(self._send, self._statuses)

    def _hand_out(self) -> tuple[Any, np.ndarray]:
        batch = self._next
        B = self._batch_size
        assert B is not None
        assert self._agreed is not None
        treedef = self._agreed[0]
        if batch is None:  # this rank's stream ended: a full batch of padding
            assert self._filler is not None
            self._ended = True
            leaves, mask = self._filler, self._empty
        else:
            self._taken += 1
            if batch.rows == B:
                leaves = batch.leaves
                mask = self._full if batch.mask is None else batch.mask
            else:
                rows = np.arange(B) % batch.rows if batch.rows else None
                leaves = [_take(leaf, rows, B) for leaf in batch.leaves]
                mask = np.zeros(B, np.bool_)
                mask[: batch.rows] = True if batch.mask is None else batch.mask
            self._filler = leaves
        self._steps += 1
        _progress.note("jaxddp.join")
        return jax.tree_util.tree_unflatten(treedef, leaves), mask

    def _finish(self) -> None:
        self._finished = True
        self._ended = True  # a state saved now resumes with nothing left to read
        close = getattr(self._iterator, "close", None)
        if callable(close):  # every rank's stream ended: let go of its files and workers
            close()

    def __del__(self) -> None:
        # A loop left early (a `break` on every rank) leaves the step's bytes in flight:
        # MPI may still write into its buffers, so they must outlive this object.
        if getattr(self, "_request", None) is not None:
            _abandoned.append((self._request, self._send, self._statuses))

    # -- the first step --------------------------------------------------------------------

    def _start(self) -> np.ndarray:
        """The first step's agreement: one gather of every rank's structure, batch size and
        status; the batch size and the structure are fixed from here on."""
        self._started = True
        if self._loaded is not None:
            self._resume(self._loaded)
        self._read()
        status = self._status()
        batch = self._next
        mine = (
            status,
            None if batch is None else batch.rows,
            None if batch is None else batch.describe(),
            self._batch_size,
            self._steps,
            None if self._problem is None else _error_payload(self._problem),
        )
        if self._size == 1:
            everyone = [mine]
        else:
            everyone = gather_with_deadline(
                self._check, mine, what="first batches of `jaxddp.join`", error=TimeoutError
            )
        statuses = np.array([e[0] for e in everyone], np.int8)
        if self._size > 1:
            _wire(self._check)  # made here, where every rank is (a collective)
        if (statuses == _FAILED).any():
            self._raise(statuses, [e[5] for e in everyone])
        self._agree(everyone)
        self._statuses[:] = statuses
        return statuses

    def _agree(self, everyone: list[tuple[Any, ...]]) -> None:
        """Fixes the batch size and the structure, or raises the same error on every rank."""
        asked = {e[3] for e in everyone}
        if len(asked) > 1:
            per_rank = ", ".join(f"rank {r}: {e[3]}" for r, e in enumerate(everyone))
            msg = (
                f"Expected every rank to pass the same `batch_size` to `jaxddp.join`, got "
                f"{per_rank} instead."
            )
            raise ValueError(msg)
        steps = {e[4] for e in everyone}
        if len(steps) > 1:
            per_rank = ", ".join(f"rank {r}: {e[4]}" for r, e in enumerate(everyone))
            msg = (
                "Expected every rank to resume `jaxddp.join` at the same step, got "
                f"{per_rank} instead. Load one saved `state_dict()` on every rank."
            )
            raise ValueError(msg)
        holders = [r for r, e in enumerate(everyone) if e[0] == _BATCH]
        if not holders:
            return  # nothing to yield on any rank
        if self._batch_size is None:
            self._batch_size = max(everyone[r][1] for r in holders)
        for r in holders:
            if everyone[r][1] > self._batch_size:
                raise ValueError(self._too_large(r, everyone[r][1]))
        first = holders[0]
        agreed = everyone[first][2]
        for r in holders[1:]:
            if everyone[r][2] != agreed:
                text = _describe_difference(r, everyone[r][2], agreed, f"rank {first}'s")
                msg = (
                    f"The first batches of `jaxddp.join` differ across ranks: {text}. Every "
                    "rank's stream must yield batches of one structure, dtypes and trailing "
                    "shapes, or the ranks' steps call different collectives."
                )
                raise TreeMismatchError(msg)
        self._description = agreed
        B = self._batch_size
        self._full = _read_only(np.ones(B, np.bool_))
        self._empty = _read_only(np.zeros(B, np.bool_))
        if self._next is not None:
            self._agreed = (self._next.treedef, self._next.kinds())
        if len(holders) < self._size:  # some rank has nothing: it pads with first's batch
            self._share_filler(first)

    def _share_filler(self, root: int) -> None:
        """The first rank with data sends its first batch, padded to the batch size, to
        every rank (once): what a rank without data yields as padding."""
        payload = None
        if self._rank == root:
            assert self._next is not None
            assert self._batch_size is not None
            rows = np.arange(self._batch_size) % self._next.rows if self._next.rows else None
            leaves = [np.asarray(_take(x, rows, self._batch_size)) for x in self._next.leaves]
            payload = jax.tree_util.tree_unflatten(self._next.treedef, leaves)
        shared = self._check.bcast(payload, root=root)
        leaves, treedef = jax.tree_util.tree_flatten(shared)
        if self._agreed is None:
            self._agreed = (treedef, tuple((x.dtype, tuple(x.shape[1:])) for x in leaves))
            self._filler = leaves
        elif self._next is None:
            self._filler = leaves

    # -- errors ----------------------------------------------------------------------------

    def _raise(self, statuses: np.ndarray, payloads: list[Any] | None = None) -> None:
        """Every rank raises at the step where some rank's stream failed: that rank its own
        exception, the others the same type for jaxddp's checks, else a RuntimeError."""
        self._finished = True
        if payloads is None:  # every rank saw the failure at this step: all gather
            mine = None if self._problem is None else _error_payload(self._problem)
            payloads = self._check.allgather(mine) if self._size > 1 else [mine]
        problem = self._problem
        if problem is not None:
            if isinstance(problem, _StreamError):
                raise problem.kind(str(problem))
            raise problem
        failed = [(r, p) for r, p in enumerate(payloads) if p is not None]
        rank, (kind, text, ours) = failed[0]
        if ours:
            raise _KINDS[kind](text)
        msg = (
            f"Rank {rank}'s stream raised {kind}: {text} (at step {self._steps + 1} of "
            "`jaxddp.join`). Every rank stops here, so that none waits for it forever."
        )
        raise RuntimeError(msg)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where every rank's stream is, after the batches handed out so far. A collective.

        A dict, identical on every rank (so the rank that writes a checkpoint holds all of
        it): ``world_size``, ``steps``, ``batch_size`` (0 before the first step) and
        ``ranks``, one entry per rank: ``taken`` (the real batches of its stream handed out),
        ``ended`` (whether its stream had ended) and, for a stream with a state of its own
        (grain's ``DatasetIterator.get_state()``), ``stream``. Call it on every rank.
        """
        mine: dict[str, Any] = {"taken": self._taken, "ended": self._ended}
        stream = self._stream_state if self._started else _get_state(self._open())
        if stream is not None:
            mine["stream"] = stream
        ranks = self._check.allgather(mine) if self._size > 1 else [mine]
        return {
            "version": _STATE_VERSION,
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
        batches again (a deterministic stream, reopened).

        Raises:
          ValueError: if the state comes from another number of ranks (each rank's stream
            is its own: it cannot be divided among more ranks or merged into fewer), or from
            another batch size, or is not a state of :func:`join`.
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
        if saved != self._size:
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
            self._stream_over = True
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

    def __repr__(self) -> str:
        return f"jaxddp.join({self._source!r}, batch_size={self._batch_size}) at step {self._steps}"


_KINDS: dict[str, type[Exception]] = {
    "TreeMismatchError": TreeMismatchError,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


def _error_payload(problem: BaseException) -> tuple[str, str, bool]:
    """What the other ranks learn of this rank's failure: its type, text, and whether it
    is one of jaxddp's checks (raised as the same type everywhere)."""
    if isinstance(problem, _StreamError):
        return problem.kind.__name__, str(problem), True
    return type(problem).__name__, str(problem), False


def _take(leaf: Any, rows: np.ndarray | None, size: int) -> Any:
    """``leaf``'s rows at ``rows`` (``size`` zero rows when it has none)."""
    if rows is None:
        return np.zeros((size, *leaf.shape[1:]), leaf.dtype)
    return leaf[rows]


def _read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def _get_state(iterator: Any) -> Any:
    get_state = getattr(iterator, "get_state", None)
    return get_state() if callable(get_state) and hasattr(iterator, "set_state") else None


def _is_jaxddp_loader(iterable: Any) -> bool:
    """Whether ``iterable`` is one of jaxddp's loaders, which yield ``(batch, mask)``."""
    return getattr(iterable, "_jaxddp_masked", False) is True


_wires: dict[int, tuple[Any, Any]] = {}
_abandoned: list[Any] = []  # requests of loops left early, kept with their buffers


def _wire(check: Any) -> Any:
    """The communicator of the per-step bytes over ``check``'s ranks: a duplicate made at
    the first step of the first join on it (a collective point), so that they never
    interleave with other traffic."""
    found = _wires.get(id(check))
    if found is None:
        found = _wires[id(check)] = (check, check.Dup())
    return found[1]
