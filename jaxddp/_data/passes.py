"""A pass over a sampler's batches: what :meth:`jaxddp.DistributedSampler.batches` yields
from, and what the loaders (``jaxddp.grain``, ``jaxddp.torch``) read their batches from."""

from __future__ import annotations

from typing import Any

from .shards import IndexArray, MaskArray

__all__ = ["BatchPass"]


class BatchPass:
    """One pass of :meth:`DistributedSampler.batches`, for the loaders built on it.

    ``count`` batches of ``batch_size`` entries of this rank's padded order, from entry
    ``start`` on; :meth:`batch` reads one (pure: a worker process may hold a pass's arrays),
    :meth:`hand_out` moves the sampler's position to the end of the first ``k`` of them.
    """

    __slots__ = ("_sampler", "batch_size", "count", "epoch", "indices", "mask", "start")

    def __init__(
        self,
        sampler: Any,  # the DistributedSampler it came from (sampler.py imports this module)
        indices: IndexArray,
        mask: MaskArray,
        *,
        start: int,
        batch_size: int,
        count: int,
    ) -> None:
        self._sampler = sampler
        self.epoch = sampler.epoch
        self.indices, self.mask = indices, mask  # the shard and its fill, read-only
        self.start, self.batch_size, self.count = start, batch_size, count

    def entries(self) -> tuple[IndexArray, MaskArray]:
        """The pass's ``count * batch_size`` indices and mask, batch after batch."""
        end = self.start + self.count * self.batch_size
        return self.indices[self.start : end].copy(), self.mask[self.start : end].copy()

    def batch(self, k: int) -> tuple[IndexArray, MaskArray]:
        begin = self.start + k * self.batch_size
        end = begin + self.batch_size
        return self.indices[begin:end].copy(), self.mask[begin:end].copy()

    def hand_out(self, k: int) -> None:
        """Sets the sampler's position to the end of the pass's first ``k`` batches."""
        sampler = self._sampler
        if k >= self.count:  # the last batch ends the epoch, also when drop_last leaves a tail
            sampler._position = sampler._n
        else:
            sampler._position = sampler._handed_out(self.start + k * self.batch_size)
