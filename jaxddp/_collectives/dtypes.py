"""The dtype rules of the reductions: which dtype a leaf is reduced in, how a mean of integers
or booleans is computed without overflow, which dtype a user gets back. Pure functions of
arrays and dtypes, NumPy or JAX alike; nothing here talks to MPI.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._types import ReduceOp
from .wire import wire_dtype

__all__ = [
    "from_halves",
    "halves",
    "is_key_dtype",
    "leaf_dtype",
    "mean",
    "narrow",
    "sum_carrier",
    "widen",
]


def is_key_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (NumPy dtypes and None never are)."""
    return not isinstance(dtype, np.dtype | None) and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def leaf_dtype(x: Any) -> Any:
    """A leaf's dtype without converting it; Python numbers by their kind."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None or not isinstance(x, bool | int | float | complex):
        return dtype
    return np.dtype(type(x))


def widen(x: Any, op: ReduceOp) -> Any:
    """A leaf in the dtype it is reduced in: booleans as uint8 for max and min (or and and)
    and as int32 for sum and mean (a count), integers for a mean as :func:`sum_carrier`
    says, bfloat16 and float16 as float32 (so a mean divides before it is rounded back),
    other dtypes MPI lacks as :func:`jaxddp._collectives.wire.wire_dtype` says."""
    if x.dtype == np.bool_:
        return x.astype(np.uint8 if op in ("max", "min") else np.int32)
    if op == "mean" and x.dtype.kind in "iu":
        return sum_carrier(x)
    wide = wire_dtype(x.dtype, arithmetic=True)
    return x if wide == x.dtype else x.astype(wide)


def _x64() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def halves(dtype: Any, traced: bool) -> bool:
    """Whether a mean of this integer dtype travels as 16-bit halves: 32-bit integers inside
    ``jax.jit`` without ``jax_enable_x64``, where no 64-bit type holds their sum."""
    dtype = np.dtype(dtype)
    return traced and dtype.kind in "iu" and dtype.itemsize == 4 and not _x64()


def sum_carrier(x: Any) -> Any:
    """An integer leaf in a form whose sum over the ranks cannot overflow, for a mean.

    8- and 16-bit integers as int32 (exact for fewer than 2**15 ranks), 32-bit ones as
    int64 or uint64, or inside ``jax.jit`` without x64 as their high and low 16 bits, two
    int32 arrays stacked on a new first axis (exact, like int32 counts); 64-bit ones as
    float64 (exact to far below the float32 the mean is rounded to). ``int8`` ``[100, 100]``
    used to wrap to -28 before the division.
    """
    dtype = np.dtype(x.dtype)
    if halves(dtype, traced=not isinstance(x, np.ndarray)):
        return jnp.stack([x >> 16, x & 0xFFFF]).astype(jnp.int32)
    if dtype.itemsize <= 2:
        wide = np.int32
    elif dtype.itemsize == 4:
        wide = np.int64 if dtype.kind == "i" else np.uint64
    else:
        wide = np.float64
    return x.astype(wide)


def from_halves(x: Any, dtype: Any) -> Any:
    """A leaf that travelled as halves (not reduced: a non-root rank's own), put back."""
    high, low = x[0].astype(dtype), x[1].astype(dtype)
    return high * dtype.type(1 << 16) + low


def narrow(x: Any, dtype: Any, op: ReduceOp) -> Any:
    """A reduced leaf back in the dtype a user gets: that of the leaf, except that a sum of
    booleans is an int32 count and a mean of integers or booleans is float32."""
    if dtype == np.bool_ and op in ("sum", "mean"):
        return x
    if op == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
        return x
    return x if x.dtype == dtype else x.astype(dtype)


def mean(x: Any, size: int, dtype: Any) -> Any:
    """The sum ``x`` of leaves of ``dtype`` divided by the world size: float32 for integer
    and boolean leaves, divided in the widest float there is, then rounded once."""
    inexact = jnp.issubdtype(dtype, jnp.inexact)
    if isinstance(x, np.ndarray):
        if inexact:  # bfloat16 and float16 arrive widened to float32
            return x / size
        return np.asarray(x / size, dtype=np.float32)
    if inexact:
        return x / size
    if halves(dtype, traced=True):  # the exact sum, rounded once to float32, then divided
        total = x[0].astype(jnp.float32) * np.float32(1 << 16) + x[1].astype(jnp.float32)
        return total / np.float32(size)
    wide = jnp.float64 if _x64() else jnp.float32
    return (x.astype(wide) / size).astype(jnp.float32)
