"""A checkpoint holds the first rank's state alone and a restore gives it to every rank, so
what is saved must be the same on every rank. Before anything is written, every rank
computes a fingerprint of each leaf and one small allgather compares them. A leaf that
differs is refused on every rank, naming its path and the ranks that hold other values: a
sharded optimizer's state flattened by ``nnx.state`` (each rank's slices, no longer marked
as such), a per-rank value saved as if replicated. The slices of a
:class:`~jaxddp.ShardedState`, which differ by design, are split off before (each rank
saves its own) and not compared.

Where: a background save (the manager's default) takes every rank's host copy on the
caller's thread (:func:`hold`) and compares the copies on the save's own thread
(:func:`compare`, on a communicator that only that thread uses, under
``MPI_THREAD_MULTIPLE``), before the writer writes; the manager's next call raises a
refusal on every rank. A blocking save compares the state where it lies, in ``save``
(:func:`same_on_every_rank`: NumPy reads a CPU array's buffer without a copy).

The fingerprint reads the leaf's bytes as 64-bit words laid out in rows of
:data:`COLUMNS` and sums them (modulo 2**64) along the columns and along the rows: any
changed word changes a sum, and any two words swapped change a row's sum or a column's.
It costs about two reads of the state (0.4x of a CRC-32 here); the CRC-32 that the
checkpoint stores is computed by the writer's background thread, as before.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from typing import Any

import numpy as np

from ..._collectives.consistency import gather_with_deadline
from ..._types import Communicator
from .background import host_copy
from .trees import _by_path, _path_text

__all__ = [
    "COLUMNS",
    "Refusal",
    "Refused",
    "compare",
    "fingerprint",
    "hold",
    "same_on_every_rank",
]

COLUMNS = 1021  # words per row: a prime, so that a leaf's own rows rarely line up with them


Refusal = tuple[type[Exception], str]
"""Why a save is refused: the exception type to raise on every rank and its whole message."""


class Refused(Exception):
    """A :data:`Refusal` raised on a save's background thread, for the manager's next call
    to raise as ``kind`` on every rank; its message is whole (``as_is``)."""

    as_is = True

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind = kind


def same_on_every_rank(comm: Communicator, tree: Any, *, step: int, doing: str,
                       copy: bool, into: Any = None) -> Any:  # fmt: skip
    """Compares every rank's ``tree`` (a storable state, its slices split off) on the
    caller's thread; collective.

    Returns what this rank holds to write: its host copy of ``tree`` when ``copy``, else
    ``tree`` (the fingerprints are taken of the copy: a device's array crosses to the host
    once; ``into``: see :func:`hold`). Raises on every rank what :func:`compare` returns."""
    held, error = hold(tree, copy=copy, into=into)
    refusal = compare(comm, held, error, step=step, doing=doing)
    if refusal is not None:
        kind, msg = refusal
        raise kind(msg)
    return held


def hold(tree: Any, *, copy: bool, into: Any = None) -> tuple[Any, Refusal | None]:
    """``(held, error)``: this rank's host copy of ``tree`` when ``copy`` (else ``tree``
    itself; ``into``: an earlier copy whose buffers it may reuse, see
    :func:`.background.host_copy`), and the error that made it fail, if any, for
    :func:`compare` to report on every rank; local."""
    try:
        return (host_copy(tree, into) if copy else tree), None
    except Exception as e:  # noqa: BLE001 - reported on every rank by compare()
        return tree, _error(e)


def compare(comm: Communicator, held: Any, error: Refusal | None, *, step: int,
            doing: str) -> Refusal | None:  # fmt: skip
    """Fingerprints ``held`` (what :func:`hold` returned, ``error`` its error) and compares
    every rank's in one small allgather; collective, on any thread (a background thread
    needs ``MPI_THREAD_MULTIPLE`` and a communicator that no other thread uses meanwhile).

    Returns the same on every rank: None where every rank holds the same values, else
    ``(type, message)`` for "Could not ``doing``": ValueError naming the first leaf that
    differs between ranks, or the first rank's error (in rank order) where its copy or its
    fingerprints failed. A rank that does not come makes the others return TimeoutError
    within ``JAXDDP_CHECK_TIMEOUT`` seconds."""
    mine = None
    if error is None and comm.Get_size() > 1:
        try:
            mine = _fingerprints(held)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = _error(e)
    try:
        everyone = (
            gather_with_deadline(
                comm, (error, mine), what=f"state saved as checkpoint {step}", error=TimeoutError
            )
            if comm.Get_size() > 1
            else [(error, [])]
        )
    except TimeoutError as e:
        return TimeoutError, f"Could not {doing}: {e}"
    for rank, (failed, _) in enumerate(everyone):
        if failed is not None:
            kind, text = failed
            return kind, f"Could not {doing} (on rank {rank}): {text}"
    differs = _difference([fingerprints for _, fingerprints in everyone])
    if differs is not None:
        return ValueError, f"Could not {doing}: {differs}"
    return None


def _error(e: Exception) -> Refusal:
    kind = ValueError if isinstance(e, ValueError) else RuntimeError
    return kind, f"{type(e).__name__}: {e}"


def fingerprint(leaf: Any) -> Any:
    """A 16-byte digest of an array's bytes (see the module's docstring); a Python number's
    or string's type and value."""
    if isinstance(leaf, bool | int | float | complex | str):
        return (type(leaf).__name__, repr(leaf))
    data = np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8)
    n = data.size // 8
    words = data[: n * 8].view(np.uint64)
    rows = n // COLUMNS
    grid = words[: rows * COLUMNS].reshape(rows, COLUMNS)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(grid.sum(axis=0, dtype=np.uint64).tobytes())  # wraps: modulo 2**64
    digest.update(grid.sum(axis=1, dtype=np.uint64).tobytes())
    digest.update(words[rows * COLUMNS :].tobytes())
    digest.update(data[n * 8 :].tobytes())
    return digest.digest()


def _fingerprints(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    """``(path, fingerprint)`` of every leaf, in flatten order. NumPy's sums release the
    GIL, so the leaves are read on a few threads at once."""
    leaves = _by_path(tree)
    workers = min(4, os.cpu_count() or 1, max(1, len(leaves)))
    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            prints = list(pool.map(fingerprint, leaves.values()))
    except RuntimeError:  # exit has begun (a save in flight at exit): no thread may start
        prints = [fingerprint(leaf) for leaf in leaves.values()]
    return list(zip(leaves, prints, strict=True))


def _difference(fingerprints: list[Any]) -> str | None:
    """The error naming the first leaf whose fingerprint differs between ranks, or None."""
    first = fingerprints[0]
    for i, (path, value) in enumerate(first):
        others = [r for r, theirs in enumerate(fingerprints) if theirs[i][1] != value]
        if not others:
            continue
        count = sum(any(t[j][1] != v for t in fingerprints) for j, (_, v) in enumerate(first))
        ranks = f"rank {others[0]} holds" if len(others) == 1 else f"ranks {_listed(others)} hold"
        more = f" (and {count - 1} more leaves)" if count > 1 else ""
        return (
            f"the state differs between ranks at `{_path_text(path)}`{more}: {ranks} other "
            "values there than rank 0. A checkpoint holds the first rank's state, and a "
            "restore gives it to every rank, so what is saved must be the same on every "
            "rank. A sharded optimizer's state saved as `nnx.state(optimizer)` does this (each "
            "rank's slices, no longer marked as slices): save `optimizer.opt_state`, the "
            "`jaxddp.ShardedState` itself, whose slices every rank saves. Anything else: make "
            "it the same on every rank before saving (`jaxddp.synchronize`, "
            "`jaxddp.average_state`), or leave what is each rank's own out of the checkpoint."
        )
    return None


def _listed(ranks: list[int]) -> str:
    """``1, 2 and 3``."""
    return ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
