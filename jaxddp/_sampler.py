"""A sharded sampler that gives every rank the same number of samples and of batches.

When the number of samples does not divide by the number of ranks, a naive split gives the
last rank fewer batches: it leaves the training loop early and the other ranks wait forever
in their next allreduce. :class:`DistributedSampler` pads the order by wrapping around from
its start, so that every rank gets the same count, and returns a mask that is False exactly
at the padding duplicates, so that metrics stay exact (see :func:`jaxddp.masked_mean`).

Everything a rank needs is a pure function of ``(N, num_replicas, rank, seed, epoch,
shuffle, drop_last)``; MPI is used only once, to check that every rank passed the same
arguments.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import numpy as np

from ._shards import IndexArray, MaskArray
from ._shards import boolean as _boolean
from ._shards import data_size as _data_size
from ._shards import integer as _integer
from ._shards import per_rank as _per_rank
from ._shards import same_setting as _same_setting
from ._shards import shard as _shard

__all__ = ["DistributedSampler"]

# Keys of a state dict besides "epoch" and "position": a state only fits a sampler that
# agrees on all of them.
_STATE_CONFIG = ("data_size", "num_replicas", "seed", "shuffle", "drop_last")


class DistributedSampler:
    """Shards sample indices across ranks so that every rank gets the same number of samples.

    The epoch's order is ``range(N)``, or when ``shuffle`` the permutation
    ``numpy.random.default_rng([seed, epoch]).permutation(N)``, identical on every rank. It
    is extended by wrapping around from its start to ``s * num_replicas`` entries, where
    ``s = ceil(N / num_replicas)``, and rank ``r`` takes the contiguous block
    ``[r*s, (r+1)*s)``. So every rank has ``s`` samples and, for any batch size, the same
    number of batches: no rank leaves the loop early while the others wait in an allreduce.
    :meth:`mask` is False exactly at the wrapped duplicates, so that the masks of all ranks
    together count each sample once (see :func:`jaxddp.masked_mean` for exact metrics).
    With ``drop_last=True`` every rank takes ``floor(N / num_replicas)`` samples instead and
    the tail of the order is dropped (the mask is all True).

    When ``comm`` is given, or ``num_replicas`` or ``rank`` is taken from the MPI world, the
    constructor is a collective over ``comm`` (the world by default): every rank of it must
    construct its sampler, and it checks once that every rank passed the same N, ``seed``,
    ``shuffle`` and ``drop_last`` (otherwise samples would silently be duplicated and
    skipped), raising ValueError on every rank if not. A rank that never constructs its
    sampler makes the others raise TimeoutError after ``JAXDDP_CHECK_TIMEOUT`` seconds
    instead of waiting forever. With ``num_replicas`` and ``rank`` given explicitly and no
    ``comm``, the sampler is a pure computation that never touches MPI.

    Iterating over the sampler, or over :meth:`batches`, is a *pass* over the epoch. A pass
    advances the position (this rank's samples of the epoch handed out so far) as it yields,
    so a :meth:`state_dict` taken after the step on a batch has that batch counted. A new
    pass starts at the epoch's beginning, except the first pass after
    :meth:`load_state_dict`, which continues with the next sample: no sample skipped, none
    repeated. :meth:`set_epoch` with a new epoch starts that epoch at position 0.

    Args:
      data: the number of samples N (an int), or any object with ``len()``.
      num_replicas: the number of ranks to shard over; by default the size of ``comm``.
      rank: this process's shard, in ``[0, num_replicas)``; by default its rank in ``comm``.
      shuffle: whether each epoch's order is a seeded permutation instead of ``range(N)``.
      seed: a non-negative integer; pass the same on every rank.
      drop_last: whether to drop the tail of the order instead of padding it. Requires
        ``N >= num_replicas``, since otherwise every rank would get nothing.
      comm: an mpi4py communicator whose ranks share the data; by default the MPI world.
        The argument check runs over its ranks only, on a private duplicate of it.

    Example:
      >>> import jaxddp
      >>> sampler = jaxddp.DistributedSampler(7, num_replicas=2, rank=1, shuffle=False)
      >>> len(sampler), list(sampler)
      (4, [4, 5, 6, 0])
      >>> sampler.mask().tolist()  # index 0 is rank 0's: here it is only padding
      [True, True, True, False]
      >>> for indices, mask in sampler.batches(3):
      ...     print(indices.tolist(), mask.tolist())
      [4, 5, 6] [True, True, True]
      [0, 4, 5] [False, False, False]
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
        comm: Any = None,
    ) -> None:
        collective = comm is not None or num_replicas is None or rank is None
        if collective:
            from . import _world

            _world.init()
            group = _world.py_comm() if comm is None else comm
            num_replicas = group.Get_size() if num_replicas is None else num_replicas
            rank = group.Get_rank() if rank is None else rank
        # Every rank validates first, and when the world is involved every rank then takes
        # part in the consistency check even if its own arguments were bad: an error raised
        # on some ranks only would leave the others waiting in that collective forever.
        problem: Exception | None = None
        try:
            self._n = _data_size(data)
            self._num_replicas = _integer("num_replicas", num_replicas, minimum=1)
            self._rank = _integer("rank", rank, minimum=0)
            if self._rank >= self._num_replicas:
                msg = (
                    f"Expected `rank` to be in [0, {self._num_replicas}) for "
                    f"`num_replicas={self._num_replicas}`, got {self._rank} instead."
                )
                raise ValueError(msg)
            self._shuffle = _boolean("shuffle", shuffle)
            self._seed = _integer("seed", seed, minimum=0)
            self._drop_last = _boolean("drop_last", drop_last)
            if self._drop_last and self._n < self._num_replicas:
                msg = (
                    f"Expected at least `num_replicas={self._num_replicas}` samples with "
                    f"`drop_last=True`, got `data` with {self._n} samples instead: every rank "
                    "would get nothing. Pass `drop_last=False` to pad with wrapped copies."
                )
                raise ValueError(msg)
        except (TypeError, ValueError) as exc:
            problem = exc
        if collective:
            from ._consistency import check_sampler_arguments

            mine = None
            if problem is None:
                mine = (self._n, self._num_replicas, self._seed, self._shuffle, self._drop_last)
                mine += (self._rank,)
            check_sampler_arguments(mine, problem, comm)
        if problem is not None:
            raise problem
        self._s = _per_rank(self._n, self._num_replicas, self._drop_last)
        self._epoch = 0
        self._position = 0  # this rank's samples of the epoch handed out by the latest pass
        self._resume = False  # whether the next pass continues at `_position` (after a load)
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

    def _shard(self) -> tuple[IndexArray, MaskArray]:
        """This epoch's indices and mask, computed once per epoch and kept read-only."""
        if self._cache is None or self._cache[0] != self._epoch:
            self._cache = None  # let the previous epoch's arrays go first
            indices, mask = _shard(
                self._n,
                self._num_replicas,
                self._rank,
                seed=self._seed,
                epoch=self._epoch,
                shuffle=self._shuffle,
                drop_last=self._drop_last,
            )
            indices.setflags(write=False)
            mask.setflags(write=False)
            self._cache = (self._epoch, indices, mask)
        return self._cache[1], self._cache[2]

    def indices(self) -> IndexArray:
        """This rank's indices for the epoch, an int64 array of length ``len(self)``.

        The whole epoch, whatever the position of a pass.
        """
        return self._shard()[0].copy()

    def mask(self) -> MaskArray:
        """A bool array aligned with :meth:`indices`: False exactly at padding duplicates.

        Summed over all ranks, the masks count N (fewer with ``drop_last=True``, which
        drops samples instead of padding).
        """
        return self._shard()[1].copy()

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

    def _start_pass(self) -> int:
        start = self._position if self._resume else 0
        self._resume = False
        self._position = start
        return start

    def __iter__(self) -> Iterator[int]:
        """Yields this rank's indices of the epoch as Python ints, from the position on."""
        start = self._start_pass()
        indices = self._shard()[0]
        return self._iterate(indices, start)

    def _iterate(self, indices: IndexArray, start: int) -> Iterator[int]:
        for position in range(start, len(indices)):
            self._position = position + 1
            yield int(indices[position])

    def num_batches(self, batch_size: int, *, drop_last: bool = False) -> int:
        """The number of batches of a whole epoch, identical on every rank.

        Args:
          batch_size: a positive integer.
          drop_last: as in :meth:`batches`.

        Returns:
          ``ceil(len(self) / batch_size)``, or ``floor`` with ``drop_last``.
        """
        batch_size = _integer("batch_size", batch_size, minimum=1)
        drop_last = _boolean("drop_last", drop_last)
        return self._s // batch_size if drop_last else -(-self._s // batch_size)

    def batches(
        self, batch_size: int, *, drop_last: bool = False
    ) -> Iterator[tuple[IndexArray, MaskArray]]:
        """Yields ``(indices, mask)`` pairs of exactly ``batch_size`` entries each.

        Every rank yields the same number of batches. A short last batch is padded to
        ``batch_size`` with this rank's first indices of the epoch (valid indices, so that
        ``data[indices]`` works) whose mask is False, so a jitted step sees one shape and
        never recompiles. The mask is also False at the sampler's own padding duplicates.

        Args:
          batch_size: a positive integer.
          drop_last: whether to drop a short last batch instead of padding it. Every rank
            then yields ``floor(len(self) / batch_size)`` batches (at least one is required).

        Returns:
          An iterator over the rest of the pass: the epoch from the start, or from the
          loaded position for the first pass after :meth:`load_state_dict`.
        """
        batch_size = _integer("batch_size", batch_size, minimum=1)
        drop_last = _boolean("drop_last", drop_last)
        if drop_last and batch_size > self._s:
            msg = (
                f"Expected `batch_size` to be at most the {self._s} samples of each rank with "
                f"`drop_last=True`, got {batch_size} instead: every rank would get no batch. "
                "Pass a smaller `batch_size` or `drop_last=False`."
            )
            raise ValueError(msg)
        start = self._start_pass()
        indices, mask = self._shard()
        return self._batches(indices, mask, start, batch_size, drop_last)

    def _batches(
        self,
        indices: IndexArray,
        mask: MaskArray,
        start: int,
        batch_size: int,
        drop_last: bool,
    ) -> Iterator[tuple[IndexArray, MaskArray]]:
        s = len(indices)
        for begin in range(start, s, batch_size):
            end = min(begin + batch_size, s)
            if end - begin < batch_size:
                if drop_last:
                    return
                fill = batch_size - (end - begin)
                # valid indices, the rank's first ones (np.resize would copy the whole shard)
                wrap = indices[np.arange(fill) % len(indices)]
                batch_indices = np.concatenate([indices[begin:end], wrap])
                batch_mask = np.zeros(batch_size, dtype=np.bool_)
                batch_mask[: end - begin] = mask[begin:end]
            else:
                batch_indices = indices[begin:end].copy()
                batch_mask = mask[begin:end].copy()
            self._position = end
            yield batch_indices, batch_mask

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The epoch and position, plus the arguments a state only fits; identical on all ranks.

        A dict of Python ints and bools (JSON-serializable): ``epoch``, ``position`` (this
        rank's samples of the epoch handed out by the latest pass, the same on every rank),
        and ``data_size``, ``num_replicas``, ``seed``, ``shuffle``, ``drop_last``, which
        :meth:`load_state_dict` checks.
        """
        return {
            "epoch": self._epoch,
            "position": self._position,
            "data_size": self._n,
            "num_replicas": self._num_replicas,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`: the next pass continues with the next sample.

        Args:
          state: what :meth:`state_dict` returned, possibly from another process and
            restored by a checkpointing library (numpy scalars are fine).

        Raises:
          ValueError: if the state comes from a sampler with another N, ``num_replicas``,
            ``seed``, ``shuffle`` or ``drop_last``, or its position is out of range.
        """
        if not isinstance(state, Mapping):
            msg = (
                "Expected `state` to be a dict from `DistributedSampler.state_dict()`, "
                f"got {type(state).__name__} instead."
            )
            raise TypeError(msg)
        missing = [k for k in ("epoch", "position", *_STATE_CONFIG) if k not in state]
        if missing:
            msg = (
                "Expected `state` to be a dict from `DistributedSampler.state_dict()`, "
                f"got one without {', '.join(map(repr, missing))} instead."
            )
            raise ValueError(msg)
        mine = self.state_dict()
        for key in _STATE_CONFIG:
            if not _same_setting(state[key], mine[key]):
                msg = (
                    f"Expected a state with `{key}={mine[key]!r}` like this sampler's, got "
                    f"`{key}={state[key]!r}` instead: a position only makes sense in the "
                    "order it was taken from. Build the sampler with the same arguments as "
                    "the run that saved the state."
                )
                raise ValueError(msg)
        epoch = _integer("state['epoch']", state["epoch"], minimum=0)
        position = _integer("state['position']", state["position"], minimum=0)
        if position > self._s:
            msg = (
                f"Expected `state['position']` to be at most the {self._s} samples of each "
                f"rank, got {position} instead."
            )
            raise ValueError(msg)
        self._epoch = epoch
        self._position = position
        self._resume = True

    def __repr__(self) -> str:
        return (
            f"DistributedSampler({self._n}, num_replicas={self._num_replicas}, "
            f"rank={self._rank}, shuffle={self._shuffle}, seed={self._seed}, "
            f"drop_last={self._drop_last})"
        )
