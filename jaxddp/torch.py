"""PyTorch's DataLoader, fed from :class:`jaxddp.DistributedSampler`:
needs torch (``pip install torch``, or a CPU build of it).

:class:`DataLoader` is a ``torch.utils.data.DataLoader`` of this rank's ``(batch, mask)``
pairs, with exact mid-epoch state; :class:`DistributedBatchSampler` and
:class:`MaskedDataset` are its two halves, for a ``DataLoader(..., batch_sampler=...)`` of
your own.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    from ._data.loaders import missing

    problem = missing("torch", "torch", error)
    raise problem from None

from ._data.loaders.torch import DataLoader, DistributedBatchSampler, Entry, MaskedDataset

__all__ = ["DataLoader", "DistributedBatchSampler", "Entry", "MaskedDataset"]
