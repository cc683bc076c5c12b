"""A sharded sampler under which W ranks with batch B see one process's batches of W*B.

When the number of samples does not divide by the number of ranks, a naive split gives the
last rank fewer batches: it leaves the training loop early and the other ranks wait forever
in their next allreduce. :class:`DistributedSampler` pads the order by wrapping around from
its start, so that every rank gets the same count, and returns a mask that is False exactly
at the padding duplicates, so that metrics stay exact (see :func:`jaxddp.masked_mean`). It
deals the order out like cards (rank ``r`` takes entries ``r, r + W, ...``), so that at every
step the ranks' batches together are the batch of one process with ``W`` times the batch
size, and a position in that global order resumes on any number of ranks.

Everything a rank needs is a pure function of ``(N, num_replicas, rank, seed, epoch,
shuffle, drop_last)`` (in ``_shards``); MPI is used only to check that every rank passed
the same arguments, and loaded the same state.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

from .._base import progress as _progress
from .._types import Communicator
from . import shards as _shards
from .passes import BatchPass
from .shards import IndexArray, MaskArray
from .shards import boolean as _boolean
from .shards import integer as _integer

__all__ = ["BatchPass", "DistributedSampler"]

# Entries past its end that a rank's cached shard holds at least: the fill of a short last
# batch, so that iterating over batches of up to this size allocates nothing of size N.
_REACH = 1024


class DistributedSampler:
    """Shards sample indices across ranks so that W ranks see one process's batches.

    The epoch's order is ``range(N)``, or when ``shuffle`` the permutation
    ``numpy.random.default_rng([seed, epoch]).permutation(N)``, identical on every rank and
    independent of their number. The *padded order* repeats it without end: position ``g``
    holds ``order[g % N]``, and is real (mask True) exactly when ``g < N``. Rank ``r`` of
    ``W`` takes positions ``r, r + W, r + 2W, ...``: ``s = ceil(N / W)`` samples per epoch,
    the same on every rank, so for any batch size every rank has the same number of
    batches and none leaves the loop early while the others wait in an allreduce.

    Batch ``k`` of size ``B`` on rank ``r`` is positions ``(k*B + i) * W + r`` for ``i`` in
    ``range(B)``: over all ranks, positions ``[k*W*B, (k+1)*W*B)``, which is batch ``k`` of
    one process with batch size ``W * B``, the same indices and masks, interleaved
    (``one_process_batch.reshape(B, W)[:, r]``). That holds for the last, short batch too:
    its positions past ``N`` hold wrapped copies with mask False, as in one process, so the
    real samples of every step are one process's and no sample counts twice. Runs on
    different numbers of ranks thus train on the same global batches, and
    :func:`jaxddp.masked_mean` over them is one process's mean. A rank's last batch is only
    padding (mask all False) when ``0 < N mod (W*B) < W``: that global batch holds fewer
    real samples than there are ranks, and ranks ``N mod (W*B)`` and above get none.
    Everything whose statistics span the ranks is safe there (:func:`jaxddp.masked_mean`,
    the gradient average, :class:`jaxddp.SyncBatchNorm`); what divides by a rank's own
    count (Flax's ``BatchNorm`` with the mask, a per-rank mean) gives ``nan``: see the docs'
    sharp bits. With ``drop_last=True`` the order is cut to its first
    ``L = floor(N / W) * W`` entries instead of being padded, and
    positions repeat those.

    When ``comm`` is given, or ``num_replicas`` or ``rank`` is taken from the MPI world, the
    sampler is collective over ``comm`` (the world by default): every rank of it must
    construct its sampler and call :meth:`load_state_dict`. The constructor checks once that
    every rank passed the same N, ``seed``, ``shuffle`` and ``drop_last`` (otherwise samples
    would silently be duplicated and skipped), raising ValueError on every rank if not; and
    every pass (iterating over the sampler or over :meth:`batches`) starts with a check that
    every rank is in the same epoch with the same ``batch_size`` (one small allgather per
    pass), raising ValueError on every rank if not. A rank that never arrives makes the
    others raise TimeoutError after ``JAXDDP_CHECK_TIMEOUT`` seconds instead of waiting
    forever. With ``num_replicas`` and ``rank`` given explicitly and no ``comm``, the
    sampler is a pure computation that never touches MPI.

    Iterating over the sampler, or over :meth:`batches`, is a *pass* over the epoch. A pass
    advances the position (the samples of the epoch's global order handed out so far, on
    all ranks together) as it yields, so a :meth:`state_dict` taken after the step on a
    batch has that batch counted. A new pass starts at the epoch's beginning, except the
    first pass after :meth:`load_state_dict`, which continues with the next sample: no
    sample skipped, none repeated, on this or another number of ranks.
    :meth:`set_epoch` with a new epoch starts that epoch at position 0.

    Args:
      data: the number of samples N (an int), or any object with ``len()``.
      num_replicas: the number of ranks to shard over; by default the size of ``comm``.
      rank: this process's shard, in ``[0, num_replicas)``; by default its rank in ``comm``.
      shuffle: whether each epoch's order is a seeded permutation instead of ``range(N)``.
      seed: a non-negative integer; pass the same on every rank.
      drop_last: whether to drop the tail of the order instead of padding it. Requires
        ``N >= num_replicas``, since otherwise every rank would get nothing.
      comm: an mpi4py communicator whose ranks share the data; by default the MPI world.
        The checks run over its ranks only, on a private duplicate of it.

    Example:
      >>> import jaxddp
      >>> sampler = jaxddp.DistributedSampler(7, num_replicas=2, rank=1, shuffle=False)
      >>> len(sampler), list(sampler)  # positions 1, 3, 5 and 7, which wraps to index 0
      (4, [1, 3, 5, 0])
      >>> sampler.mask().tolist()  # index 0 is rank 0's: here it is only padding
      [True, True, True, False]
      >>> for indices, mask in sampler.batches(3):  # rank 0 has [0, 2, 4] and [6, 1, 3]
      ...     print(indices.tolist(), mask.tolist())
      [1, 3, 5] [True, True, True]
      [0, 2, 4] [False, False, False]
    """

    def __init__(
        self,
        data: int | Sized,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        comm: Communicator | None = None,
    ) -> None:
        collective = comm is not None or num_replicas is None or rank is None
        options = {"shuffle": shuffle, "seed": seed, "drop_last": drop_last}
        if collective:  # every rank checks that the others passed the same
            from .agreement import agreed_arguments

            arguments = agreed_arguments(data, num_replicas, rank, comm=comm, **options)
        else:
            arguments = _shards.arguments(data, num_replicas=num_replicas, rank=rank, **options)
        self._n, self._num_replicas, self._rank = arguments[:3]
        self._shuffle, self._seed, self._drop_last = arguments[3:]
        self._comm, self._collective = comm, collective  # not collective: pure, no checks
        self._s = _shards.per_rank(self._n, self._num_replicas, self._drop_last)
        self._epoch = 0
        self._position = 0  # the epoch's global samples handed out by the latest pass
        self._resume = False  # whether the next pass continues at `_position` (after a load)
        self._reach = _REACH  # entries past the shard's end that the cache holds
        self._cache: tuple[int, IndexArray, MaskArray] | None = None

    # -- the shard ------------------------------------------------------------------------

    @property
    def data_size(self) -> int:
        """N, the number of samples in the data set."""
        return self._n

    @property
    def num_replicas(self) -> int:
        """The number of ranks the data is sharded over."""
        return self._num_replicas

    @property
    def rank(self) -> int:
        """This process's shard."""
        return self._rank

    @property
    def epoch(self) -> int:
        """The epoch whose order is used, set by :meth:`set_epoch`."""
        return self._epoch

    def __len__(self) -> int:
        """The number of samples of this rank per epoch, identical on every rank."""
        return self._s

    def _shard(self, reach: int = 0) -> tuple[IndexArray, MaskArray]:
        """This epoch's entries and mask, and at least ``reach`` more past the shard's end.

        Computed once per epoch (again only for a longer reach) and kept read-only.
        """
        if reach > self._reach:
            self._reach = reach
            self._cache = None
        if self._cache is None or self._cache[0] != self._epoch:
            self._cache = None  # let the previous epoch's arrays go first
            indices, mask = _shards.shard(
                self._n,
                self._num_replicas,
                self._rank,
                seed=self._seed,
                epoch=self._epoch,
                shuffle=self._shuffle,
                drop_last=self._drop_last,
                extra=self._reach,
            )
            indices.setflags(write=False)
            mask.setflags(write=False)
            self._cache = (self._epoch, indices, mask)
        return self._cache[1], self._cache[2]

    def indices(self) -> IndexArray:
        """This rank's indices for the epoch, an int64 array of length ``len(self)``.

        The whole epoch, whatever the position of a pass.
        """
        return self._shard()[0][: self._s].copy()

    def mask(self) -> MaskArray:
        """A bool array aligned with :meth:`indices`: False exactly at padding duplicates.

        Summed over all ranks, the masks count N (fewer with ``drop_last=True``, which
        drops samples instead of padding).
        """
        return self._shard()[1][: self._s].copy()

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose order is used; call it with the same epoch on every rank.

        A new epoch starts at position 0. Setting the current epoch again changes nothing,
        so that a loop ``for epoch in range(sampler.epoch, n): sampler.set_epoch(epoch)``
        continues a loaded state.
        """
        epoch = _integer("epoch", epoch, minimum=0)
        if epoch != self._epoch:
            self._epoch = epoch
            self._position = 0
            self._resume = False

    # -- passes ---------------------------------------------------------------------------

    def _check_pass(self, batch_size: int | None = None, drop_last: bool = False) -> None:
        """A collective sampler checks that every rank starts the same pass (epoch,
        ``batch_size``, ``drop_last``): once per pass, one small allgather."""
        if self._collective:
            from .agreement import check_sampler_pass

            check_sampler_pass((self._epoch, batch_size, drop_last), self._comm)

    def _start_pass(self) -> int:
        """This rank's first entry of the pass: 0, or the loaded position's."""
        start = self._next_start()
        self._position = self._position if self._resume else 0
        self._resume = False
        return start

    def _next_start(self) -> int:
        """The first entry of the next pass, which :meth:`_start_pass` will start."""
        position = self._position if self._resume else 0
        return self._s if position >= self._n else position // self._num_replicas

    def _handed_out(self, entries: int) -> int:
        """The global position once every rank has handed out ``entries``: N at the end."""
        return entries * self._num_replicas if entries < self._s else self._n

    def __iter__(self) -> Iterator[int]:
        """Yields this rank's indices of the epoch as Python ints, from the position on."""
        self._check_pass()
        start = self._start_pass()
        indices = self._shard()[0]
        return self._iterate(indices, start)

    def _iterate(self, indices: IndexArray, start: int) -> Iterator[int]:
        for entry in range(start, self._s):
            self._position = self._handed_out(entry + 1)
            _progress.note("DistributedSampler iteration")
            yield int(indices[entry])

    def num_batches(self, batch_size: int, *, drop_last: bool = False) -> int:
        """The number of batches of a whole epoch, identical on every rank.

        Args:
          batch_size: a positive integer.
          drop_last: as in :meth:`batches`.

        Returns:
          ``ceil(len(self) / batch_size)``, which is ``ceil(N / (W * batch_size))``; with
          ``drop_last``, ``floor(N / (W * batch_size))``, the batches without padding.
        """
        batch_size = _integer("batch_size", batch_size, minimum=1)
        drop_last = _boolean("drop_last", drop_last)
        return self._count(0, batch_size, drop_last)

    def _count(self, start: int, batch_size: int, drop_short: bool) -> int:
        return _shards.batch_count(
            self._n,
            self._num_replicas,
            start,
            batch_size,
            drop_last=self._drop_last,
            drop_short=drop_short,
        )

    def batches(
        self, batch_size: int, *, drop_last: bool = False
    ) -> Iterator[tuple[IndexArray, MaskArray]]:
        """Yields ``(indices, mask)`` pairs of exactly ``batch_size`` entries each.

        Every rank yields the same number of batches, and batch ``k`` of all ranks together
        is batch ``k`` of one process with batch size ``W * batch_size``. A short last batch
        continues the padded order past its end (valid indices, so that ``data[indices]``
        works) with mask False, so a jitted step sees one shape and never recompiles.

        Args:
          batch_size: a positive integer.
          drop_last: whether to drop the last batch when some of its ``W * batch_size``
            positions are padding. Every rank then yields ``floor(N / (W * batch_size))``
            batches, with all of their masks True; at least one is required.

        Returns:
          An iterator over the rest of the pass: the epoch from the start, or from the
          loaded position for the first pass after :meth:`load_state_dict`.
        """
        return self._batches(self._batch_pass(batch_size, drop_last))

    def _batch_pass(self, batch_size: int, drop_last: bool) -> BatchPass:
        """Starts a pass over batches (the checks of :meth:`batches` included): what the
        loaders (``jaxddp.grain``, ``jaxddp.torch``) read their batches from."""
        batch_size = _integer("batch_size", batch_size, minimum=1)
        drop_last = _boolean("drop_last", drop_last)
        self._check_pass(batch_size, drop_last)
        length = _shards.epoch_length(self._n, self._num_replicas, self._drop_last)
        if drop_last:
            _shards.check_batches_fit(batch_size, self._num_replicas, length)
        start = self._start_pass()
        count = self._count(start, batch_size, drop_last)
        indices, mask = self._shard(start + count * batch_size - self._s)
        return BatchPass(self, indices, mask, start=start, batch_size=batch_size, count=count)

    def _pending_batches(self, batch_size: int, drop_last: bool) -> int:
        """How many batches the next pass will yield (from the loaded position, if any)."""
        batch_size = _integer("batch_size", batch_size, minimum=1)
        drop_last = _boolean("drop_last", drop_last)
        return self._count(self._next_start(), batch_size, drop_last)

    def _batches(self, batches: BatchPass) -> Iterator[tuple[IndexArray, MaskArray]]:
        for k in range(batches.count):
            batches.hand_out(k + 1)  # counted as it is yielded: see state_dict
            _progress.note("DistributedSampler.batches")
            yield batches.batch(k)

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the global position, plus the settings a state only fits.

        A dict of Python ints and bools (JSON-serializable), identical on all ranks:
        ``epoch``, ``position`` (the samples of the epoch's global order that all ranks
        together have handed out, N once the epoch is done), and ``data_size``, ``seed``,
        ``shuffle``, ``drop_last``, which :meth:`load_state_dict` checks. The number of
        ranks is not part of it: the state resumes on any number that divides the position.
        """
        return {
            "epoch": self._epoch,
            "position": self._position,
            "data_size": self._n,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`: the next pass continues with the next sample.

        The state may come from a run on another number of ranks ``W``: a run saved after
        ``k`` steps of batch ``B`` is at position ``k * W * B``, which this sampler's
        ``W'`` ranks can continue if ``W'`` divides it. Batches of size ``B'`` then cover
        the rest of the global order from the position on; when ``W' * B' = W * B`` (the
        same global batch) they are exactly the batches the uninterrupted run had left.
        A state at the end of an epoch (position N) resumes on any number of ranks.

        A collective over the sampler's communicator unless ``num_replicas`` and ``rank``
        were given without ``comm``: every rank must call it, with the same state.

        Args:
          state: what :meth:`state_dict` returned, possibly from another process and
            restored by a checkpointing library (numpy scalars are fine).

        Raises:
          ValueError: if the state comes from a sampler with another N, ``seed``,
            ``shuffle`` or ``drop_last``, if its position is out of range or not a multiple
            of ``num_replicas``, or (on every rank) if the ranks loaded different states.
        """
        problem: Exception | None = None
        loaded: tuple[int, int] | None = None
        try:
            loaded = _shards.resume_point(
                state,
                n=self._n,
                num_replicas=self._num_replicas,
                seed=self._seed,
                shuffle=self._shuffle,
                drop_last=self._drop_last,
            )
        except (TypeError, ValueError) as exc:
            problem = exc
        if self._collective:
            # Every rank takes part even when its own state was bad: see __init__.
            from .agreement import check_sampler_states

            check_sampler_states(loaded, problem, self._comm)
        if problem is not None:
            raise problem
        assert loaded is not None
        self._epoch, self._position = loaded
        self._resume = True

    def __repr__(self) -> str:
        return (
            f"DistributedSampler({self._n}, num_replicas={self._num_replicas}, "
            f"rank={self._rank}, shuffle={self._shuffle}, seed={self._seed}, "
            f"drop_last={self._drop_last})"
        )
