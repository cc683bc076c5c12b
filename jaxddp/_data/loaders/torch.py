"""PyTorch's DataLoader reads the batches of :class:`jaxddp.DistributedSampler` (see
``jaxddp.torch``).

The batch sampler yields each batch as a list of :class:`Entry` (an index and whether it
is a real sample or padding); :class:`MaskedDataset` reads ``dataset[entry.index]`` and
returns ``(sample, is_real)``, so that PyTorch's default collate gives ``(batch, mask)``,
also in worker processes. An :class:`Entry` is not an int on purpose: a dataset that was
not wrapped fails on it at once instead of silently losing the mask.

A DataLoader with workers asks its batch sampler for batches ahead of the loop
(``prefetch_factor * num_workers`` of them), so only :class:`DataLoader`, which sees the
loop take each batch, moves the sampler's position exactly; the bare batch sampler moves it
as batches are handed to the DataLoader, which is exact with ``num_workers=0`` only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data

from ..._base import progress as _progress
from ..sampler import BatchPass, DistributedSampler

__all__ = ["DataLoader", "DistributedBatchSampler", "Entry", "MaskedDataset"]


class Entry:
    """One slot of a batch: ``index`` into the data set and ``real``, False at padding."""

    __slots__ = ("index", "real")

    def __init__(self, index: int, real: bool) -> None:
        self.index, self.real = index, real

    def __reduce__(self) -> tuple[Any, ...]:
        return (Entry, (self.index, self.real))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return (self.index, self.real) == (other.index, other.real)

    def __hash__(self) -> int:
        return hash((self.index, self.real))

    def __repr__(self) -> str:
        return f"Entry({self.index}, real={self.real})"


class DistributedBatchSampler(torch.utils.data.Sampler[list[Entry]]):
    """A PyTorch batch sampler over a :class:`jaxddp.DistributedSampler`'s batches.

    ``DataLoader(MaskedDataset(dataset), batch_sampler=DistributedBatchSampler(sampler,
    16))`` yields this rank's batches of ``sampler.batches(16)`` as ``(batch, mask)``. Each
    batch is a list of :class:`Entry`; wrap the dataset in :class:`MaskedDataset`, which
    reads them. ``len()`` is the number of batches of the coming pass, the same on every
    rank; :meth:`set_epoch`, :meth:`state_dict` and :meth:`load_state_dict` are the
    sampler's. Iterating starts a pass of the sampler (a collective: every rank must).

    The position of the sampler moves as batches are handed to the DataLoader; with
    ``num_workers > 0`` the DataLoader takes them ahead of the loop, so checkpoint
    mid-epoch through :class:`jaxddp.torch.DataLoader`, which counts what the loop took.

    Args:
      sampler: the :class:`jaxddp.DistributedSampler` whose shard and state are used.
      batch_size: the per-rank batch size.
      drop_last: as in :meth:`jaxddp.DistributedSampler.batches`.
    """

    def __init__(
        self, sampler: DistributedSampler, batch_size: int, *, drop_last: bool = False
    ) -> None:
        if not isinstance(sampler, DistributedSampler):
            msg = (
                "Expected `sampler` to be a jaxddp.DistributedSampler, got "
                f"{type(sampler).__name__} instead."
            )
            raise TypeError(msg)
        sampler._pending_batches(batch_size, drop_last)  # the arguments' checks, now
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self._on_dispatch = True  # jaxddp.torch.DataLoader moves the position itself
        self._pass: BatchPass | None = None

    def __len__(self) -> int:
        return self.sampler._pending_batches(self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[list[Entry]]:
        # The pass starts at the first batch asked for, not here: PyTorch's DataLoader with
        # workers calls iter() twice and drops the first iterator, which would otherwise
        # start (and spend a loaded position on) a pass of its own.
        batches = self.sampler._batch_pass(self.batch_size, self.drop_last)
        self._pass = batches
        for k in range(batches.count):
            if self._on_dispatch:
                batches.hand_out(k + 1)
            indices, mask = batches.batch(k)
            yield [Entry(int(i), bool(m)) for i, m in zip(indices, mask, strict=True)]

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class MaskedDataset(torch.utils.data.Dataset):
    """Reads :class:`Entry` items: ``dataset[entry.index]`` and ``entry.real``.

    Each item is ``(sample, is_real)``, so PyTorch's default collate gives
    ``(batch, mask)`` with ``mask`` a bool tensor. A dataset with ``__getitems__`` (a
    batched read) is read a batch at a time.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, entry: Entry) -> tuple[Any, bool]:
        return self.dataset[_index(entry)], entry.real

    def __getitems__(self, entries: list[Entry]) -> list[tuple[Any, bool]]:
        indices = [_index(e) for e in entries]
        many = getattr(self.dataset, "__getitems__", None)
        samples = many(indices) if many else [self.dataset[i] for i in indices]
        return list(zip(samples, (e.real for e in entries), strict=True))


def _index(entry: Any) -> int:
    if not isinstance(entry, Entry):
        msg = (
            f"Expected an item of jaxddp.torch.DistributedBatchSampler, got {entry!r} "
            "instead: MaskedDataset reads the batches of that batch sampler. Pass "
            "`batch_sampler=jaxddp.torch.DistributedBatchSampler(sampler, batch_size)`."
        )
        raise TypeError(msg)
    return entry.index


class DataLoader(torch.utils.data.DataLoader):
    """A PyTorch DataLoader of this rank's batches of a :class:`jaxddp.DistributedSampler`.

    ``DataLoader(dataset, sampler, batch_size, num_workers=2)`` is
    ``torch.utils.data.DataLoader(MaskedDataset(dataset),
    batch_sampler=DistributedBatchSampler(sampler, batch_size), num_workers=2)``, plus
    exact mid-epoch state: the sampler's position moves as the loop takes each
    ``(batch, mask)``, however far the workers have read ahead, so :meth:`state_dict` (the
    sampler's) counts exactly the batches trained on, as torchdata's StatefulDataLoader's
    does. Iterate once per epoch, after :meth:`set_epoch`.

    Args:
      dataset: any map-style dataset (``len`` and ``dataset[i]``) of the sampler's N samples.
      sampler: the :class:`jaxddp.DistributedSampler` whose shard and state are used.
      batch_size: the per-rank batch size.
      drop_last: as in :meth:`jaxddp.DistributedSampler.batches`.
      **kwargs: the rest of ``torch.utils.data.DataLoader``'s arguments (``num_workers``,
        ``collate_fn``, ``pin_memory``, ``persistent_workers``, ...), except the ones the
        batch sampler decides (``batch_size``, ``shuffle``, ``sampler``, ``drop_last``).
    """

    _jaxddp_masked = True  # jaxddp.join takes its items as (batch, mask) pairs

    def __init__(
        self,
        dataset: Any,
        sampler: DistributedSampler,
        batch_size: int,
        *,
        drop_last: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(sampler, DistributedSampler) and len(dataset) != sampler.data_size:
            msg = (
                f"Expected `dataset` to hold the sampler's {sampler.data_size} samples, got "
                f"{len(dataset)} instead. Build the sampler from this dataset: "
                "jaxddp.DistributedSampler(len(dataset), ...)."
            )
            raise ValueError(msg)
        batches = DistributedBatchSampler(sampler, batch_size, drop_last=drop_last)
        batches._on_dispatch = False
        super().__init__(MaskedDataset(dataset), batch_sampler=batches, **kwargs)
        self._batches = batches

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._follow(super().__iter__())

    def _follow(self, inner: Iterator[Any]) -> Iterator[Any]:
        batches: BatchPass | None = None
        for taken, batch in enumerate(inner, start=1):
            if batches is None:  # the pass the batch sampler started for this iteration
                batches = self._batches._pass
                assert batches is not None
            batches.hand_out(taken)
            _progress.note("jaxddp.torch.DataLoader")
            yield batch

    def set_epoch(self, epoch: int) -> None:
        """``sampler.set_epoch(epoch)``."""
        self._batches.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's ``state_dict()``: the batches the loop took count, none ahead."""
        return self._batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``sampler.load_state_dict(state)`` (a collective); the next pass continues."""
        self._batches.load_state_dict(state)
