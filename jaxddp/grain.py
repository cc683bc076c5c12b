"""grain, fed from :class:`jaxddp.DistributedSampler`: needs ``pip install grain``.

:func:`batches` is :meth:`jaxddp.DistributedSampler.batches` with the samples read by a
grain pipeline: every rank gets its interleaved, padded batches with their masks, and the
iterator's state is the sampler's. Importing this module also makes grain's
``ShardByJaxProcess`` refuse to shard under MPI, where JAX sees one process per rank;
:func:`shard_options` is the right sharding there, for per-rank streams (an
``IterDataset`` per rank, filtered or packed) that :func:`jaxddp.join` evens out.
"""

from __future__ import annotations

try:
    import grain as _grain  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    from ._data.loaders import missing

    problem = missing("grain", "grain", error)
    raise problem from None

from ._data.loaders.grain import ShardedBatches, batches, shard_options

__all__ = ["ShardedBatches", "batches", "shard_options"]
