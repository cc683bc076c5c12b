"""Exact metrics across ranks despite padded samples."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._collectives import host as _host
from .._collectives import signature as _signature
from .._collectives.api import channels, is_concrete, mpi_op_of, reduce_all
from .._types import Communicator

__all__ = ["masked_mean"]


def masked_mean(values: Any, mask: Any, *, comm: Communicator | None = None) -> jax.Array:
    """The mean over every rank's entries where ``mask`` is True; usable inside ``jax.jit``.

    The masked sum and the count are each summed over all ranks with
    :func:`jaxddp.allreduce`, so the result is the exact mean over the samples of all ranks,
    whatever their share: padding duplicates from :class:`jaxddp.DistributedSampler` (mask
    False) are ignored, even when they hold ``nan`` or ``inf``. Every rank must call it.

    It is the documented way to write a loss: ``masked_mean(per_sample_loss, mask)`` is
    the loss one process computes on the global batch, and its gradient (jaxddp's
    collectives differentiate like ``jax.lax.psum``), averaged over the ranks by
    :func:`jaxddp.allreduce_gradients`, is one process's gradient, on padded and short
    batches too.

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
      bfloat16 and float16 values are summed and divided in float32 (in float64 outside
      ``jax.jit``), then rounded once to their dtype.

    Example:
      >>> import jax, jax.numpy as jnp, jaxddp
      >>> loss = jnp.array([1.0, 2.0, 3.0, 100.0])
      >>> mask = jnp.array([True, True, True, False])  # the last entry is padding
      >>> float(jax.jit(jaxddp.masked_mean)(loss, mask))  # on one rank
      2.0
    """
    if is_concrete(values) and is_concrete(mask):
        return _host_masked_mean(np.asarray(values), np.asarray(mask), comm)
    values = jnp.asarray(values)
    mask = jnp.asarray(mask)
    _check(values, mask)
    dtype = values.dtype if jnp.issubdtype(values.dtype, jnp.inexact) else jnp.float32
    # bfloat16 and float16 are summed in float32: 4096 entries of 20.0 overflow float16
    wide = jnp.promote_types(dtype, jnp.float32)
    where = mask.reshape(mask.shape + (1,) * (values.ndim - mask.ndim))
    axes = tuple(range(mask.ndim))
    total = jnp.sum(jnp.where(where, values.astype(wide), jnp.zeros((), wide)), axis=axes)
    count = jnp.sum(mask, dtype=jnp.int32)
    reduced = reduce_all(
        {"total": total, "count": count},
        "sum",
        comm=comm,
        what="values of `masked_mean`",
        call="masked_mean",
    )
    return (reduced["total"] / reduced["count"].astype(wide)).astype(dtype)


def _check(values: Any, mask: Any) -> None:
    if mask.dtype != np.bool_:
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


def _host_masked_mean(values: np.ndarray, mask: np.ndarray, comm: Communicator | None) -> Any:
    """The same mean on concrete values, in NumPy: the masked sums (accumulated in double
    precision) and the count travel in one buffer, one MPI call."""
    _check(values, mask)
    kind = values.dtype.kind
    inexact = kind in "fc" or jnp.issubdtype(values.dtype, jnp.inexact)
    dtype = values.dtype if inexact else np.dtype(np.float32)
    wide = np.complex128 if kind == "c" else np.float64
    picked = values[mask]  # the real entries, stacked: padding (even nan) never summed
    tail = values.shape[mask.ndim :]
    if tail:
        buffer = np.empty(math.prod(tail) + 1, wide)
        np.add.reduce(picked, axis=0, dtype=wide, out=buffer[:-1].reshape(tail))
        buffer[-1] = len(picked)
    else:  # one value per sample, the common case: kept short
        buffer = np.array([np.add.reduce(picked, dtype=wide), len(picked)], wide)
    _, size, _, host_comm = channels(comm)
    if size > 1:
        rows = None
        if _signature.enabled():  # the sums and the count travel with the check if they fit
            rows = _signature.agree(
                host_comm,
                ("masked_mean", buffer.dtype, tail),
                lambda: _host_signature(buffer.dtype, tail),
                what="values of `masked_mean`",
                traced=False,
                payload=buffer,
            )
        if rows is None:
            host_comm.Allreduce(_host.in_place(), buffer, mpi_op_of("sum"))
        else:
            np.add.reduce(rows, axis=0, out=buffer)
    if buffer[-1] == 0:  # no rank has a real entry
        return np.full(tail, np.nan, dtype)
    return np.asarray((buffer[:-1] / buffer[-1]).reshape(tail), dtype)


def _host_signature(wide: Any, tail: tuple[int, ...]) -> _signature.Signature:
    """What the ranks must agree on before a masked mean's buffer travels: its dtype and
    the shape of one sample (the sums of one sample's entries, then the count)."""
    kind = f"{np.dtype(wide).name}[{','.join(map(str, tail))}]"
    return ("masked_mean", "sum", None, [("one sample of `values`", kind)])
