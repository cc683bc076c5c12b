"""Floats as integers that order as the floats do: the one rule for a maximum or minimum of
floats on every path.

MPI's MAX and MIN of floats keep a NaN or drop it depending on the MPI library and on which
rank holds it, and XLA's ``pmax`` drops another rank's NaN; each also picks either zero where
ranks hold -0.0 and +0.0. Reduced as these keys, a NaN on any rank is the result (as
``jnp.maximum`` has it) and -0.0 < +0.0 (IEEE 754's ``maximum`` and ``minimum``), whichever
rank holds which value: the lowering sends them through MPI, the xla path reduces them with
``pmax``/``pmin``, and jaxddp's shared-memory allreduce compares the same keys
(``jaxddp/_native/allreduce.cc``, ``combine_ordered``), so every path gives the same bits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KEY_TYPES", "floats", "keys"]

KEY_TYPES = {np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}


def keys(x: Any, largest: bool) -> Any:
    """Floats as integers of the same order: a negative float's bits below its sign
    flipped; a NaN as the largest integer (``largest``, for a maximum) or the smallest."""
    itype = KEY_TYPES[np.dtype(x.dtype)]
    info = np.iinfo(itype)
    bits = jax.lax.bitcast_convert_type(x, itype)
    ordered = jnp.where(bits < 0, bits ^ itype(info.max), bits)
    return jnp.where(jnp.isnan(x), itype(info.max if largest else info.min), ordered)


def floats(keys: Any, dtype: Any) -> Any:
    """What :func:`keys` made, back as floats (a NaN's key back as a NaN: all ones below the
    sign, which is clear for a maximum's and set for a minimum's)."""
    flip = np.iinfo(keys.dtype).max
    return jax.lax.bitcast_convert_type(jnp.where(keys < 0, keys ^ flip, keys), dtype)
