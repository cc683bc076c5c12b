"""Batch norm over the global batch: the masked statistics of every rank's samples.

Flax's ``BatchNorm`` computes its statistics from the batch it sees: on W ranks, each
rank's shard, so a W-rank run normalizes differently from one process on the global batch,
and a rank whose batch is only padding (mask all False) divides by a count of zero.
:class:`SyncBatchNorm` (NNX) and :class:`LinenSyncBatchNorm` (linen) sum the masked moments
over the ranks, so every rank normalizes with the global batch's statistics, keeps identical
running averages, and stays finite when its own batch holds no real sample; the gradient
flows through the allreduce as one process's does. Needs flax; ``jaxddp.SyncBatchNorm`` and
``jaxddp.LinenSyncBatchNorm`` import this module (and flax) on first use.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from .._collectives.api import allreduce
from .._types import Communicator

__all__ = ["LinenSyncBatchNorm", "SyncBatchNorm", "global_moments"]


def _axes(ndim: int, axis: Any) -> tuple[int, ...]:
    axes = axis if isinstance(axis, tuple | list) else (axis,)
    return tuple(sorted(a % ndim for a in axes))


def _refuse_axis_name(axis_name: Any) -> None:
    if axis_name is not None:
        msg = (
            "SyncBatchNorm averages over MPI ranks, not a named JAX axis: drop "
            f"`axis_name={axis_name!r}` (use Flax's BatchNorm for pmap/shard_map)."
        )
        raise ValueError(msg)


def global_moments(
    x: Any,
    mask: Any,
    feature_axes: tuple[int, ...],
    *,
    dtype: Any = None,
    fast_variance: bool = True,
    comm: Communicator | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The mean and variance over every rank's entries of ``x`` where ``mask`` is True.

    The statistics Flax's batch norm computes on one process from the global batch: per
    feature (``feature_axes``), over all other axes, in ``dtype`` promoted to at least
    float32. With ``fast_variance`` the sums of ``x``, ``x**2`` and the count travel in one
    allreduce and the variance is ``E[x**2] - E[x]**2`` (Flax's ``use_fast_variance=True``);
    otherwise a second allreduce sums ``(x - mean)**2``, as Flax's two-pass variance does,
    which stays accurate when a batch holds few real samples far from zero. A rank whose
    mask is all False adds zeros: its own count may be 0, only the global one may not (it is
    never, for the sampler's batches). Every rank of ``comm`` must call it.
    """
    x = jnp.asarray(x)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    wide_dtype = jnp.promote_types(dtype or x.dtype, jnp.float32)
    wide = x.astype(wide_dtype)
    where = jnp.ones(x.shape, bool) if mask is None else _per_entry(jnp.asarray(mask), x)
    zero = jnp.zeros((), wide_dtype)

    def masked_sum(values: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(where, values, zero), reduction_axes)

    sums = {"x": masked_sum(wide), "count": jnp.sum(where, reduction_axes, dtype=wide_dtype)}
    if fast_variance:
        sums["x2"] = masked_sum(wide * wide)
    total = allreduce(sums, op="sum", comm=comm)
    mean = total["x"] / total["count"]
    if fast_variance:
        var = jnp.maximum(0.0, total["x2"] / total["count"] - mean * mean)
    else:
        centered = wide - jnp.expand_dims(mean, reduction_axes)
        var = allreduce(masked_sum(centered * centered), op="sum", comm=comm) / total["count"]
    return mean, var


def _normalize(
    x: jax.Array,
    mean: jax.Array,
    var: jax.Array,
    *,
    scale: Any,
    bias: Any,
    feature_axes: tuple[int, ...],
    epsilon: float,
    dtype: Any,
) -> jax.Array:
    """``(x - mean) * (rsqrt(var + epsilon) * scale) + bias``, in Flax's order of operations,
    computed in the statistics' (at least float32) dtype; returned in ``dtype``, or when it is
    None in the dtype of ``x``, ``scale`` and ``bias`` promoted together."""
    out_dtype = dtype or jnp.result_type(x, *(v for v in (scale, bias) if v is not None))
    x = x.astype(jnp.promote_types(mean.dtype, jnp.float32))
    shape = [1] * x.ndim
    for a in feature_axes:
        shape[a] = x.shape[a]
    mul = jax.lax.rsqrt(var.reshape(shape) + epsilon)
    if scale is not None:
        mul = mul * scale.reshape(shape)
    y = (x - mean.reshape(shape)) * mul
    if bias is not None:
        y = y + bias.reshape(shape)
    return y.astype(out_dtype)


class SyncBatchNorm(nnx.BatchNorm):
    """``flax.nnx.BatchNorm`` whose statistics are those of the global batch.

    A drop-in for ``nnx.BatchNorm`` in a data-parallel model: the same constructor
    arguments, variables (``nnx.BatchStat`` ``mean`` and ``var``, ``nnx.Param`` ``scale``
    and ``bias``) and call, plus ``comm``. In training mode it sums every rank's masked sums
    of ``x`` and ``x**2`` and the count of real entries with one allreduce (inside
    ``jax.jit`` a single small collective), so W ranks with batch B normalize exactly as
    one process with batch W*B, padding excluded through ``mask``, and every rank keeps the
    same running statistics. A rank whose batch is only padding (the sampler gives one such
    a batch when ``N mod (W*B) < W``) normalizes with the other ranks' statistics and stays
    finite. The variance is ``E[x**2] - E[x]**2`` computed in at least float32, as Flax's
    default (``use_fast_variance=True``); with ``use_fast_variance=False`` a second
    allreduce computes the two-pass variance ``E[(x - E[x])**2]``, as Flax does then. In
    evaluation mode (``use_running_average``) it is ``nnx.BatchNorm`` and communicates
    nothing. Every rank must call it, the same number of times.

    Args:
      num_features: the size of the feature axis.
      comm: an mpi4py communicator whose ranks form the global batch; by default the world.
      **kwargs: ``nnx.BatchNorm``'s (``momentum``, ``epsilon``, ``axis``,
        ``use_fast_variance``, ``rngs``, ...). ``axis_name`` is refused (the ranks are not
        a named JAX axis).

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

    def __init__(
        self, num_features: int, *, comm: Communicator | None = None, **kwargs: Any
    ) -> None:
        _refuse_axis_name(kwargs.get("axis_name"))
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
        mean, var = global_moments(
            x,
            mask,
            feature_axes,
            dtype=self.dtype,
            fast_variance=self.use_fast_variance,
            comm=_comm_of(self),
        )
        momentum = self.momentum
        self.mean[...] = jax.lax.stop_gradient(
            momentum * self.mean[...] + (1 - momentum) * mean.astype(self.mean[...].dtype)
        )
        self.var[...] = jax.lax.stop_gradient(
            momentum * self.var[...] + (1 - momentum) * var.astype(self.var[...].dtype)
        )
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None else self.bias[...]
        return _normalize(
            x, mean, var, scale=scale, bias=bias, feature_axes=feature_axes,
            epsilon=self.epsilon, dtype=self.dtype,
        )  # fmt: skip


class LinenSyncBatchNorm(nn.BatchNorm):
    """``flax.linen.BatchNorm`` whose statistics are those of the global batch.

    The linen counterpart of :class:`SyncBatchNorm`: the same fields as ``nn.BatchNorm``
    (``use_running_average``, ``momentum``, ``epsilon``, ``axis``, ``use_fast_variance``,
    ...), the same variables (``batch_stats`` ``mean`` and ``var``, ``params`` ``scale``
    and ``bias``) and call, plus ``comm``. In training mode the masked statistics are summed
    over the ranks (one small allreduce, two with ``use_fast_variance=False``), so W ranks
    with batch B normalize exactly as one process with batch W*B, keep identical
    ``batch_stats`` without :func:`jaxddp.average_state`, and a rank whose batch is only
    padding stays finite. During ``init`` it communicates nothing and, like Flax's, leaves
    the running statistics at their initial values. Every rank must call it, the same
    number of times. Linen names an unnamed module after its class (``LinenSyncBatchNorm_0``
    where Flax's is ``BatchNorm_0``): pass ``name=`` to keep the paths of a model that used
    ``nn.BatchNorm``, e.g. to restore its checkpoints.

    Its call takes ``mask`` either with one entry per sample (the sampler's mask) or
    broadcastable to ``x`` as Flax's does. ``axis_name`` is refused.

    Example:
      >>> import jax, jax.numpy as jnp, jaxddp
      >>> norm = jaxddp.LinenSyncBatchNorm(use_running_average=False)
      >>> x = jnp.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [100.0, 100.0, 100.0]])
      >>> mask = jnp.array([True, True, False])  # the last row is padding
      >>> variables = norm.init(jax.random.key(0), x)
      >>> y, _ = norm.apply(variables, x, mask=mask, mutable=["batch_stats"])
      >>> y[:2].round(3).tolist()  # on one rank
      [[-1.0, 0.0, 1.0], [1.0, 0.0, -1.0]]
    """

    comm: Communicator | None = None

    @nn.compact
    def __call__(  # type: ignore[override]
        self, x: Any, use_running_average: bool | None = None, *, mask: Any = None
    ) -> jax.Array:
        _refuse_axis_name(self.axis_name)
        running = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        x = jnp.asarray(x)
        feature_axes = _axes(x.ndim, self.axis)
        feature_shape = tuple(x.shape[a] for a in feature_axes)
        stats_dtype = jnp.float32 if self.force_float32_reductions else self.param_dtype
        ra_mean = self.variable(
            "batch_stats", "mean", lambda s: jnp.zeros(s, stats_dtype), feature_shape
        )
        ra_var = self.variable(
            "batch_stats", "var", lambda s: jnp.ones(s, stats_dtype), feature_shape
        )
        if running:
            mean, var = jnp.asarray(ra_mean.value), jnp.asarray(ra_var.value)
        elif self.is_initializing():
            # no collective during init: ranks may initialize alone (or on other shapes)
            reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
            wide = x.astype(jnp.promote_types(self.dtype or x.dtype, jnp.float32))
            mean, var = jnp.mean(wide, reduction_axes), jnp.var(wide, reduction_axes)
        else:
            mean, var = global_moments(
                x,
                mask,
                feature_axes,
                dtype=self.dtype,
                fast_variance=self.use_fast_variance,
                comm=self.comm,
            )
            m = self.momentum
            ra_mean.value = m * ra_mean.value + (1 - m) * mean.astype(stats_dtype)
            ra_var.value = m * ra_var.value + (1 - m) * var.astype(stats_dtype)
        scale = bias = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, feature_shape, self.param_dtype)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, feature_shape, self.param_dtype)
        return _normalize(
            x, mean, var, scale=scale, bias=bias, feature_axes=feature_axes,
            epsilon=self.epsilon, dtype=self.dtype,
        )  # fmt: skip


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
