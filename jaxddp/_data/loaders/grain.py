"""grain reads the batches of :class:`jaxddp.DistributedSampler` (see ``jaxddp.grain``).

A pass is a grain pipeline of its own: a ``MapDataset`` of the pass's entries (this rank's
indices and mask, plain arrays, so that ``mp_prefetch``'s worker processes can hold them),
batched by grain, read with the given ``ReadOptions`` and ``MultiprocessingOptions``. The
iterator in front of it counts the batches the training loop has taken and moves the
sampler's position as it yields them, so that its state (the sampler's ``state_dict()``)
never runs ahead with grain's prefetching.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from ..._base import progress as _progress
from ..sampler import BatchPass, DistributedSampler

__all__ = ["ShardedBatches", "batches", "shard_options"]


def batches(
    dataset: Any,
    sampler: DistributedSampler,
    batch_size: int,
    *,
    drop_last: bool = False,
    read_options: grain.ReadOptions | None = None,
    multiprocessing_options: grain.MultiprocessingOptions | None = None,
) -> ShardedBatches:
    """This rank's batches of ``sampler``, read by grain: ``(batch, mask)`` pairs.

    The grain form of ``sampler.batches(batch_size)``: each pass (iterating over the
    returned dataset) yields the sampler's batches of the current epoch, from its position
    on, with the samples read from ``dataset`` and stacked by grain (``batch`` has the
    structure of one sample with a leading axis of ``batch_size``), and ``mask`` a bool
    array that is False at the padding. The sampler's position moves as the loop takes
    each batch, however far grain's workers have read ahead, and the iterator's
    ``get_state()`` is ``sampler.state_dict()``: saved with a checkpoint, either resumes
    mid-epoch, also on another number of ranks (``set_state`` is ``load_state_dict``).

    Args:
      dataset: the samples, one per index: a ``grain.MapDataset`` (its lazy ``map`` and
        ``random_map`` run in grain's workers) or anything ``grain.MapDataset.source``
        takes (a grain data source, a sequence). Its length must be the sampler's N, and it
        must not be sharded already (grain's sharding splits the data unevenly).
      sampler: the :class:`jaxddp.DistributedSampler` whose shard and state are used.
      batch_size: the per-rank batch size.
      drop_last: as in :meth:`jaxddp.DistributedSampler.batches`.
      read_options: grain's ``ReadOptions`` (threads reading ahead in this process).
      multiprocessing_options: grain's ``MultiprocessingOptions``: worker processes that
        read and transform batches (``mp_prefetch``); by default none.

    Returns:
      A ``grain.IterDataset``; iterate over it once per epoch, after
      ``sampler.set_epoch(epoch)``, like ``sampler.batches(batch_size)``.
    """
    return ShardedBatches(
        dataset,
        sampler,
        batch_size,
        drop_last=drop_last,
        read_options=read_options,
        multiprocessing_options=multiprocessing_options,
    )


def _as_map_dataset(dataset: Any) -> grain.MapDataset:
    if isinstance(dataset, grain.MapDataset):
        return dataset
    if isinstance(dataset, grain.IterDataset | grain.DataLoader):
        msg = (
            f"Expected `dataset` to be a grain.MapDataset or a data source (random access "
            f"by index), got a {type(dataset).__name__} instead: jaxddp picks each rank's "
            "samples by index. Pass the MapDataset (or source) before `.to_iter_dataset()`, "
            "and leave sharding and batching to jaxddp.grain.batches."
        )
        raise TypeError(msg)
    return grain.MapDataset.source(dataset)


def _check_unsharded(dataset: grain.MapDataset) -> None:
    """Refuses a dataset that grain already sharded: a slice with a step (``ds[r::W]``)."""
    todo: list[Any] = [dataset]
    while todo:
        node = todo.pop()
        step = getattr(node, "_step", None)
        if type(node).__name__ == "SliceMapDataset" and isinstance(step, int) and step > 1:
            msg = (
                f"Expected `dataset` to hold every sample, got one sliced with a step of "
                f"{step} ({node}) instead: sharding by slicing gives ranks different numbers "
                "of batches, and jaxddp shards the data itself. Pass the unsliced dataset; "
                "jaxddp.grain.batches gives every rank its interleaved, padded share."
            )
            raise ValueError(msg)
        todo.extend(getattr(node, "parents", ()))


class _PassSamples(grain.MapDataset):
    """The samples of one pass, in order: ``(dataset[index], is_real)``. Pure and small
    (the pass's entries), so that grain can send it to its worker processes."""

    def __init__(self, parent: grain.MapDataset, indices: np.ndarray, mask: np.ndarray) -> None:
        super().__init__(parent)
        self._indices, self._mask = indices, mask

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        return self._parent[int(self._indices[index])], bool(self._mask[index])

    def __str__(self) -> str:
        return f"jaxddp.grain pass ({len(self._indices)} samples)"


def _absl_flags_readable() -> None:
    """grain 0.2.18's ``mp_prefetch`` reads an absl flag, which raises
    ``UnparsedFlagAccessError`` in a program that does not run under ``absl.app`` when JAX
    is imported (https://github.com/google/grain/issues/1355, fixed after 0.2.18). Its
    defaults are read instead."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class ShardedBatches(grain.IterDataset):
    """What :func:`batches` returns: a ``grain.IterDataset`` of ``(batch, mask)`` pairs
    whose passes are the sampler's and whose iterator state is ``sampler.state_dict()``."""

    _jaxddp_masked = True  # jaxddp.join takes its items as (batch, mask) pairs

    def __init__(
        self,
        dataset: Any,
        sampler: DistributedSampler,
        batch_size: int,
        *,
        drop_last: bool = False,
        read_options: grain.ReadOptions | None = None,
        multiprocessing_options: grain.MultiprocessingOptions | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(sampler, DistributedSampler):
            msg = (
                "Expected `sampler` to be a jaxddp.DistributedSampler, got "
                f"{type(sampler).__name__} instead."
            )
            raise TypeError(msg)
        source = _as_map_dataset(dataset)
        _check_unsharded(source)
        if len(source) != sampler.data_size:
            msg = (
                f"Expected `dataset` to hold the sampler's {sampler.data_size} samples, got "
                f"{len(source)} instead. Build the sampler from this dataset: "
                "jaxddp.DistributedSampler(len(dataset), ...)."
            )
            raise ValueError(msg)
        sampler._pending_batches(batch_size, drop_last)  # the arguments' checks, now
        self._source, self._sampler = source, sampler
        self._batch_size, self._drop_last = batch_size, drop_last
        self._read_options = read_options
        self._multiprocessing_options = multiprocessing_options

    def __len__(self) -> int:
        """The number of batches the next pass yields (from a loaded position, if any)."""
        return self._sampler._pending_batches(self._batch_size, self._drop_last)

    def __iter__(self) -> _ShardedIterator:
        return _ShardedIterator(self)

    def _pipeline(self, batches: BatchPass) -> grain.DatasetIterator:
        """grain's iterator over one pass's batches."""
        indices, mask = batches.entries()
        samples = _PassSamples(self._source, indices, mask)
        ds = samples.batch(batches.batch_size).to_iter_dataset(self._read_options)
        options = self._multiprocessing_options
        if options is not None and options.num_workers > 0:
            _absl_flags_readable()
            ds = ds.mp_prefetch(options)
        return iter(ds)

    def __str__(self) -> str:
        return f"jaxddp.grain.batches({self._source}, {self._sampler!r}, {self._batch_size})"


class _ShardedIterator(grain.DatasetIterator):
    """One pass: grain reads ahead, the sampler's position follows what was yielded."""

    def __init__(self, loader: ShardedBatches) -> None:
        super().__init__()
        self._loader = loader
        self._begin()

    def _begin(self) -> None:
        loader = self._loader
        # a collective: every rank starts the same pass (epoch, batch size)
        self._pass = loader._sampler._batch_pass(loader._batch_size, loader._drop_last)
        self._inner = loader._pipeline(self._pass)
        self._taken = 0

    def __next__(self) -> Any:
        if self._taken >= self._pass.count:
            self._close_inner()
            raise StopIteration
        batch = next(self._inner)
        self._taken += 1
        self._pass.hand_out(self._taken)
        _progress.note("jaxddp.grain.batches")
        return batch

    def get_state(self) -> dict[str, Any]:
        """The sampler's ``state_dict()``: the batches taken so far count, none ahead."""
        return self._loader._sampler.state_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        """``sampler.load_state_dict(state)`` (a collective), then the pass continues there."""
        self._loader._sampler.load_state_dict(state)
        self._close_inner()
        self._begin()

    def _close_inner(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        self._close_inner()
        super().close()


# -- grain's own sharding under MPI --------------------------------------------------------


def shard_options(*, drop_remainder: bool = False, comm: Any = None) -> grain.sharding.ShardOptions:
    """grain's ``ShardOptions`` for this MPI rank: shard ``rank`` of ``world_size``.

    What grain's ``ShardByJaxProcess()`` would be if JAX knew of MPI (without
    ``jax.distributed`` it says process 0 of 1 on every rank, so every rank would read the
    whole data set). For the pipelines whose shards each rank reads on its own, as a stream:
    ``grain.DataLoader(..., shard_options=...)``, or a dataset sliced with it,
    ``dataset[options.shard_index::options.shard_count]``; the shards may then yield
    different numbers of batches, which :func:`jaxddp.join` evens out. (For random access,
    :func:`batches` with a :class:`jaxddp.DistributedSampler` shards by itself.)

    Args:
      drop_remainder: grain's: whether every shard gets ``floor(N / world_size)`` records.
      comm: an mpi4py communicator whose ranks share the data; by default the MPI world.

    Example:
      >>> import jaxddp.grain
      >>> jaxddp.grain.shard_options()  # on one rank
      ShardOptions(shard_index=0, shard_count=1, drop_remainder=False)
    """
    from ..._runtime.world import init

    group = init().py_comm if comm is None else comm
    return grain.sharding.ShardOptions(
        shard_index=group.Get_rank(), shard_count=group.Get_size(), drop_remainder=drop_remainder
    )


def _refuse_jax_process_sharding(original: Any) -> Any:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        from ..._runtime.world import in_loader_worker, world_size

        original(self, *args, **kwargs)  # asks JAX for its process index and count
        world = 1 if in_loader_worker() else world_size()
        index, count = self.shard_index, self.shard_count
        if world > 1 and count != world:
            msg = (
                f"grain.sharding.ShardByJaxProcess() sees JAX process {index} of {count}, but "
                f"this job has {world} MPI ranks (JAX knows nothing of MPI without "
                "jax.distributed): every rank would read the whole data set. Shard with "
                "jaxddp instead: jaxddp.grain.batches(dataset, jaxddp.DistributedSampler("
                "len(dataset)), batch_size) gives every rank its interleaved, padded share, "
                "with the same number of batches on every rank."
            )
            raise ValueError(msg)

    init._jaxddp_refuses = True  # type: ignore[attr-defined]
    return init


def _guard_grain_sharding(classes: Sequence[type]) -> None:
    for cls in classes:
        if not getattr(cls.__init__, "_jaxddp_refuses", False):
            cls.__init__ = _refuse_jax_process_sharding(cls.__init__)  # type: ignore[misc]


_guard_grain_sharding([grain.sharding.ShardByJaxProcess])
