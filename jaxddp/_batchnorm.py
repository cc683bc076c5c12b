"""Batch norm over the global batch: the masked statistics of every rank's samples.

Flax's ``BatchNorm`` computes its statistics from the batch it sees: on W ranks, each
rank's shard, so a W-rank run normalizes differently from one process on the global batch.
:class:`SyncBatchNorm` sums the (masked) first and second moments over the ranks with one
allreduce, so every rank normalizes with the global batch's statistics and keeps identical
running averages; its gradient flows through that allreduce as one process's does.
Needs flax; ``jaxddp.SyncBatchNorm`` imports this module (and flax) on first use.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ._comm import allreduce

__all__ = ["SyncBatchNorm"]


def _axes(ndim: int, axis: Any) -> tuple[int, ...]:
    axes = axis if isinstance(axis, tuple | list) else (axis,)
    return tuple(sorted(a % ndim for a in axes))


class SyncBatchNorm(nnx.BatchNorm):
    """``flax.nnx.BatchNorm`` whose statistics are those of the global batch.

    A drop-in for ``nnx.BatchNorm`` in a data-parallel model: the same constructor
    arguments, variables (``nnx.BatchStat`` ``mean`` and ``var``, ``nnx.Param`` ``scale``
    and ``bias``) and call, plus ``comm``. In training mode it sums every rank's masked sums
    of ``x`` and ``x**2`` and the count of real entries with one allreduce (inside
    ``jax.jit`` a single small collective), so W ranks with batch B normalize exactly as
    one process with batch W*B, padding excluded through ``mask``, and every rank keeps the
    same running statistics. The variance is ``E[x**2] - E[x]**2`` computed in at least
    float32, as Flax's default (``use_fast_variance``). In evaluation mode
    (``use_running_average``) it is ``nnx.BatchNorm`` and communicates nothing. Every rank
    must call it, the same number of times.

    Args:
      num_features: the size of the feature axis.
      comm: an mpi4py communicator whose ranks form the global batch; by default the world.
      **kwargs: ``nnx.BatchNorm``'s (``momentum``, ``epsilon``, ``axis``, ``rngs``, ...).
        ``axis_name`` is refused (the ranks are not a named JAX axis), and so is
        ``use_fast_variance=False``.

    Its call takes ``mask`` either with one entry per sample (the sampler's mask, shape
    ``x.shape[:mask.ndim]``) or broadcastable to ``x`` as Flax's does.

    Example:
      >>> import jax.numpy as jnp, jaxddp
      >>> from flax import nnx
      >>> norm = jaxddp.SyncBatchNorm(3, rngs=nnx.Rngs(0))
      >>> x = jnp.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [100.0, 100.0, 100.0]])
      >>> mask = jnp.array([True, True, False])  # the last row is padding
      >>> norm(x, mask=mask[:, None])[:2].round(3).tolist()  # on one rank
      [[-1.0, 0.0, 1.0], [1.0, 0.0, -1.0]]
    """

    def __init__(self, num_features: int, *, comm: Any = None, **kwargs: Any) -> None:
        if kwargs.get("axis_name") is not None:
            msg = (
                "SyncBatchNorm averages over MPI ranks, not a named JAX axis: drop "
                f"`axis_name={kwargs['axis_name']!r}` (use nnx.BatchNorm for pmap/shard_map)."
            )
            raise ValueError(msg)
        if kwargs.get("use_fast_variance", True) is not True:
            msg = (
                "SyncBatchNorm computes the variance as E[x**2] - E[x]**2 over the global "
                "batch, in one allreduce (Flax's use_fast_variance=True): drop "
                "`use_fast_variance=False`."
            )
            raise ValueError(msg)
        super().__init__(num_features, **kwargs)
        # NNX keeps plain attributes in the graph definition, which must be hashable: the
        # module holds a key, the communicator stays here.
        self.comm_key = None if comm is None else id(comm)
        if comm is not None:
            _COMMS[id(comm)] = comm

    def __call__(
        self, x: Any, use_running_average: bool | None = None, *, mask: Any = None
    ) -> jax.Array:
        running = self.use_running_average if use_running_average is None else use_running_average
        if running is None or running:
            return super().__call__(x, use_running_average, mask=mask)
        x = jnp.asarray(x)
        feature_axes = _axes(x.ndim, self.axis)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        dtype = jnp.promote_types(self.dtype or x.dtype, jnp.float32)
        wide = x.astype(dtype)
        where = jnp.ones(x.shape, bool) if mask is None else _per_entry(jnp.asarray(mask), x)
        zero = jnp.zeros((), dtype)
        sums = {
            "x": jnp.sum(jnp.where(where, wide, zero), reduction_axes),
            "x2": jnp.sum(jnp.where(where, wide * wide, zero), reduction_axes),
            "count": jnp.sum(where, reduction_axes, dtype=dtype),
        }
        total = allreduce(sums, op="sum", comm=_comm_of(self))
        mean = total["x"] / total["count"]
        var = jnp.maximum(0.0, total["x2"] / total["count"] - mean * mean)
        momentum = self.momentum
        self.mean[...] = jax.lax.stop_gradient(
            momentum * self.mean[...] + (1 - momentum) * mean.astype(self.mean[...].dtype)
        )
        self.var[...] = jax.lax.stop_gradient(
            momentum * self.var[...] + (1 - momentum) * var.astype(self.var[...].dtype)
        )
        shape = [1] * x.ndim
        for a in feature_axes:
            shape[a] = x.shape[a]
        y = (wide - mean.reshape(shape)) * jax.lax.rsqrt(var.reshape(shape) + self.epsilon)
        if self.scale is not None:
            y = y * self.scale[...].reshape(shape)
        if self.bias is not None:
            y = y + self.bias[...].reshape(shape)
        out_dtype = self.dtype or jnp.result_type(x, *(
            v[...] for v in (self.scale, self.bias) if v is not None
        ))  # fmt: skip
        return y.astype(out_dtype)


_COMMS: dict[int, Any] = {}


def _per_entry(mask: jax.Array, x: jax.Array) -> jax.Array:
    """The mask over every entry of ``x``: a mask with one entry per sample (the sampler's,
    of shape ``x.shape[:mask.ndim]``) is extended over the trailing axes; otherwise it must
    broadcast to ``x``, as Flax's ``BatchNorm`` requires."""
    if mask.ndim < x.ndim and mask.shape == x.shape[: mask.ndim]:
        mask = mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))
    try:
        return jnp.broadcast_to(mask, x.shape)
    except ValueError:
        msg = (
            f"Expected `mask` of shape {x.shape[:1]} (one entry per sample) or one that "
            f"broadcasts to the input's {x.shape}, got shape {mask.shape} instead."
        )
        raise ValueError(msg) from None


def _comm_of(module: SyncBatchNorm) -> Any:
    return None if module.comm_key is None else _COMMS[module.comm_key]
