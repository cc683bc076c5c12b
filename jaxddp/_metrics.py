"""Exact metrics across ranks despite padded samples."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._comm import allreduce

__all__ = ["masked_mean"]


def masked_mean(values: Any, mask: Any, *, comm: Any = None) -> jax.Array:
    """The mean over every rank's entries where ``mask`` is True; usable inside ``jax.jit``.

    The masked sum and the count are each summed over all ranks with
    :func:`jaxddp.allreduce`, so the result is the exact mean over the samples of all ranks,
    whatever their share: padding duplicates from :class:`jaxddp.DistributedSampler` (mask
    False) are ignored, even when they hold ``nan`` or ``inf``. Every rank must call it.

    Args:
      values: an array whose leading axes are the samples, e.g. a per-sample loss of shape
        ``(batch,)`` or per-sample vectors of shape ``(batch, k)``.
      mask: a boolean array whose shape is the leading part of ``values.shape`` (usually
        ``(batch,)``). It is broadcast over the trailing axes of ``values``.
      comm: an mpi4py communicator whose ranks' entries are averaged; by default the whole
        world. Every rank of it must call.

    Returns:
      An array of shape ``values.shape[mask.ndim:]``, identical on every rank: the mean over
      the mask's axes. Its dtype is that of ``values``, or float32 for integer or boolean
      ``values``. Where no rank has a True entry the count is 0 and the result is ``nan``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxddp
      >>> loss = jnp.array([1.0, 2.0, 3.0, 100.0])
      >>> mask = jnp.array([True, True, True, False])  # the last entry is padding
      >>> float(jax.jit(jaxddp.masked_mean)(loss, mask))  # on one rank
      2.0
    """
    values = jnp.asarray(values)
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        msg = (
            f"Expected `mask` to be a boolean array, got dtype {mask.dtype} instead. "
            "Pass the mask from `DistributedSampler`, or compare, e.g. `weights > 0`."
        )
        raise TypeError(msg)
    if mask.shape != values.shape[: mask.ndim]:
        msg = (
            f"Expected `mask` to have the leading shape of `values` {values.shape}, got shape "
            f"{mask.shape} instead. The mask has one entry per sample (the leading axes)."
        )
        raise ValueError(msg)
    dtype = values.dtype if jnp.issubdtype(values.dtype, jnp.inexact) else jnp.float32
    where = mask.reshape(mask.shape + (1,) * (values.ndim - mask.ndim))
    axes = tuple(range(mask.ndim))
    total = jnp.sum(jnp.where(where, values.astype(dtype), jnp.zeros((), dtype)), axis=axes)
    count = jnp.sum(mask, dtype=jnp.int32)
    reduced = allreduce({"total": total, "count": count}, op="sum", comm=comm)
    return reduced["total"] / reduced["count"].astype(dtype)
