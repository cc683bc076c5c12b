"""The narrow allreduce of gradient compression (``allreduce_gradients(compression="bf16")``,
``"fp16"``), as a composition of two moves: what it is wherever jaxddp's own CPU handler
(``jaxddp/_native/narrow.cc``, the same arithmetic, pipelined) does not run it: in a program
for a GPU, inside ``jaxddp.spmd`` with ``JAXDDP_COLLECTIVES=xla``, without jaxddp's handlers.

The float32 leaves, seen as one vector ``v`` (their concatenation, plus this rank's residual
with error feedback), are cut into ``size`` blocks, block ``r`` owned by rank ``r``. Each
rank rounds ``v`` to the narrow dtype (:func:`to_narrow`) and sends block ``r`` to rank ``r``
(an alltoall of the narrow bits); rank ``r`` adds the blocks it got in float32, in rank
order, multiplies by ``1/size`` for a mean, rounds the result once and sends it to every rank (an
allgather of the narrow bits). Twice the narrow bytes of the vector cross the wire per rank
(``2 (size - 1) / size`` of it), half of a float32 allreduce's. This rank's error: ``v``
minus its rounding, plus, on its own block, what the second rounding lost (times ``size``
for a mean, as every rank divides its residual's share by ``size`` again); an error that is
not finite is 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CODES", "composed", "to_narrow"]

CODES = {np.dtype(jnp.bfloat16): 0, np.dtype(jnp.float16): 1}  # as narrow.cc knows them


def to_narrow(x: Any, dtype: Any) -> Any:
    """``x`` rounded to ``dtype``; a finite value beyond its range saturates to its largest
    (the excess stays in the residual), an infinity or a NaN stays what it is."""
    big = float(jnp.finfo(dtype).max)
    return jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x).astype(dtype)


_MAX_COUNT = (1 << 31) - 1  # an MPI count is an int (the MPI path's moves send a row's count)


def _in_columns(call: Callable[[Any], Any], x: Any) -> Any:
    """``call`` on a ``(rows, n)`` buffer in column pieces that an MPI count holds."""
    n = x.shape[1]
    if n <= _MAX_COUNT:
        return call(x)
    pieces = [call(x[:, a : a + _MAX_COUNT]) for a in range(0, n, _MAX_COUNT)]
    return jnp.concatenate(pieces, axis=1)


def composed(
    xs: Sequence[Any],
    residual: Any,
    dtype: Any,
    mean: bool,
    *,
    alltoall: Callable[[Any], Any],
    allgather: Callable[[Any], Any],
    size: int,
    me: Any,
) -> tuple[list[Any], Any]:
    """The reduced float32 arrays and, where a ``residual`` is given, this rank's error
    (else None). ``alltoall`` takes a ``(size, k)`` buffer of uint16 and ``allgather`` a
    ``(k,)`` one (stacked: ``(size, k)``); ``me`` is this rank (traced on the xla path)."""
    v = jnp.concatenate([jnp.ravel(x) for x in xs])
    if residual is not None:
        v = v + residual
    length = v.shape[0]
    k = -(-length // size)
    padded = jnp.concatenate([v, jnp.zeros((k * size - length,), v.dtype)])
    narrow = to_narrow(padded, dtype)
    bits = jax.lax.bitcast_convert_type(narrow, jnp.uint16).reshape(size, k)
    got = jax.lax.bitcast_convert_type(_in_columns(alltoall, bits), dtype)
    total = got[0].astype(jnp.float32)
    for j in range(1, size):  # in rank order, in float32
        total = total + got[j].astype(jnp.float32)
    if mean:  # times 1/size (XLA's own rewrite of a division by a scalar, made explicit), and
        # rounded before anything else uses it: no multiply-add fused across (the handler,
        # narrow.cc, gives the same bits)
        total = jax.lax.optimization_barrier(total * (np.float32(1) / np.float32(size)))
    block = to_narrow(total, dtype)
    rows = _in_columns(
        lambda b: allgather(b[0]), jax.lax.bitcast_convert_type(block, jnp.uint16)[None]
    )
    everyone = jax.lax.bitcast_convert_type(rows, dtype).reshape(-1)
    out, start = [], 0
    for x in xs:
        out.append(everyone[start : start + x.size].astype(jnp.float32).reshape(x.shape))
        start += x.size
    if residual is None:
        return out, None
    error = padded - narrow.astype(jnp.float32)
    # rounded on its own before the sum, as the handler does (XLA would fuse a multiply-add)
    missed = jax.lax.optimization_barrier(
        (total - block.astype(jnp.float32)) * (size if mean else 1)
    )
    own = jax.lax.dynamic_slice(error, (me * k,), (k,)) + missed
    error = jax.lax.dynamic_update_slice(error, own, (me * k,))
    return out, jnp.where(jnp.isfinite(error), error, 0.0)[:length]
