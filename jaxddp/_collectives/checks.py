"""The checks of a collective's arguments, made before anything is sent, from what every rank
whose tree matches sees alike: the op, the root, and whether each leaf can be reduced. The
errors name the leaf and the fix.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .._types import PyTree, ReduceOp
from .dtypes import is_key_dtype, leaf_dtype

__all__ = ["OPS", "check_op", "check_reducible", "check_root", "is_number_or_array", "leaf_path"]


OPS = ("sum", "mean", "max", "min")


def check_op(op: str) -> str:
    """Validates a reduction name; returns it."""
    if op not in OPS:
        msg = f"Expected `op` to be one of {', '.join(map(repr, OPS))}, got {op!r} instead."
        raise ValueError(msg)
    return op


def check_root(root: int, size: int) -> int:
    """Validates a root rank against the world size; returns it."""
    if isinstance(root, bool) or not isinstance(root, int | np.integer) or not 0 <= root < size:
        msg = f"Expected `root` to be a rank in [0, {size}), got {root!r} instead."
        raise ValueError(msg)
    return int(root)


def leaf_path(tree: PyTree, index: int) -> str:
    """The path (``jax.tree_util.keystr``) of the ``index``-th leaf of ``tree``, for errors."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.keystr(flat[index][0])


def check_reducible(
    tree: PyTree, leaves: list[Any], op: ReduceOp, what: str, *, others_pass: bool = False
) -> None:
    """Raises, naming the leaf, for a leaf that ``op`` cannot reduce: anything but an array
    or a number (a string, a function: TypeError), a typed PRNG key (TypeError), or a
    complex number with ``max``/``min`` (ValueError). With ``others_pass``, leaves that are
    neither arrays nor numbers are left to pass unchanged.

    Decided from dtypes alone, before anything is sent, so every rank (whose trees match)
    raises the same error and no rank is left waiting in a collective.
    """
    for i, leaf in enumerate(leaves):
        dtype = leaf_dtype(leaf)
        if others_pass and not is_number_or_array(leaf):
            continue  # a rooted collective gives such leaves back unchanged
        if dtype is None or (not is_key_dtype(dtype) and np.dtype(dtype).kind in "OSU"):
            kind = type(leaf).__name__ if dtype is None else f"{type(leaf).__name__} of {dtype}"
            msg = (
                f"`{what}` got a {kind} at `{leaf_path(tree, i)}`, which is not an array of "
                "numbers or booleans: it cannot be reduced. Leave it out of the tree (with "
                "Equinox, `eqx.filter(tree, eqx.is_array)`; with Flax NNX, `nnx.state(model, "
                "nnx.Param)`), or send other objects with mpi4py's lowercase methods."
            )
            raise TypeError(msg)
        if is_key_dtype(dtype):
            msg = (
                f"`{what}` cannot reduce the PRNG key at `{leaf_path(tree, i)}` "
                f"({dtype}{list(np.shape(leaf))}): keys are not numbers to add or compare. "
                "Expected arrays of numbers or booleans; give every rank root's keys with "
                "`jaxddp.broadcast` or `jaxddp.synchronize`, or leave the keys out of the "
                "tree (e.g. `nnx.state(model, nnx.Param)`)."
            )
            raise TypeError(msg)
        if op in ("max", "min") and np.dtype(dtype).kind == "c":
            msg = (
                f"`{what}` with op={op!r} got a complex leaf at `{leaf_path(tree, i)}` "
                f"({np.dtype(dtype).name}), which has no order. Expected real or boolean leaves "
                "for 'max' and 'min'; reduce its real and imaginary parts (or its absolute "
                "value) instead, or use 'sum' or 'mean'."
            )
            raise ValueError(msg)


def is_number_or_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | complex)
