"""Uneven per-rank streams: every rank takes the same number of fixed-shape steps.

When each rank reads a stream of its own (its own files, a filter, sequence packing, a grain
``IterDataset``, a PyTorch ``IterableDataset``), the ranks' streams end after different
numbers of batches, and the rank that runs out first leaves the loop while the others wait
forever in their next allreduce. :func:`join` wraps a rank's stream and yields
``(batch, mask)`` on every rank until the *last* rank's stream ends: a rank whose stream
ended yields padding-only batches (mask all False), which :func:`jaxddp.masked_mean`, the
gradient average and :class:`jaxddp.SyncBatchNorm` count as nothing.

``batches.py`` holds what is done to one batch (no MPI), ``stream.py`` the steps,
``wire.py`` what the ranks say at each step and how it travels, ``state.py`` the state that
resumes a run mid-stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .stream import JoinedStream

__all__ = ["JoinedStream", "join"]


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
    stream that raises, a batch that cannot be made into arrays, or a later batch that is
    too large or of another structure, raises on every rank at that batch's step, after the
    batches before it (the rank's own exception on that rank, an error naming it on the
    others), so no rank is left waiting. Each step counts as progress for the stall
    inspector. The stream is read a few batches ahead of the loop (``DEPTH``, 3), so that
    the ranks' agreement on each step travels while the steps before it compute. Leaves
    that are not JAX arrays (NumPy arrays, PyTorch CPU tensors) are copied as they are read
    (a stream may refill one buffer) and yielded as NumPy arrays; JAX arrays stay JAX
    arrays. Padding is a new array at every step (a step may donate its batch).

    Leave the loop at the same step on every rank (a ``break`` on a condition they share),
    or not at all: a rank that iterates on after another left raises an error naming it
    where it would wait for that rank. Whatever a join left in flight, the next join over
    the same ranks starts clean.

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
      :meth:`~JoinedStream.state_dict`, :meth:`~JoinedStream.load_state_dict` and
      :meth:`~JoinedStream.close`.

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
