"""The pure core of :class:`jaxddp.DistributedSampler`: argument checks and one rank's shard.

Everything here is a function of plain numbers, ``(N, num_replicas, rank, seed, epoch,
shuffle, drop_last)``: no MPI, no state.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "IndexArray",
    "MaskArray",
    "boolean",
    "data_size",
    "integer",
    "order_block",
    "per_rank",
    "same_setting",
    "shard",
]

IndexArray = npt.NDArray[np.int64]
MaskArray = npt.NDArray[np.bool_]


def integer(name: str, value: Any, *, minimum: int) -> int:
    """``value`` as a Python int, or a TypeError/ValueError naming ``name``."""
    if isinstance(value, bool | np.bool_):
        msg = f"Expected `{name}` to be an integer, got the boolean {value!r} instead."
        raise TypeError(msg)
    try:
        number = operator.index(value)
    except TypeError:
        msg = (
            f"Expected `{name}` to be an integer, got {value!r} of type "
            f"{type(value).__name__} instead."
        )
        raise TypeError(msg) from None
    if number < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}[minimum]
        msg = f"Expected `{name}` to be {kind}, got {number} instead."
        raise ValueError(msg)
    return number


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        msg = f"Expected `{name}` to be True or False, got {value!r} instead."
        raise TypeError(msg)
    return bool(value)


def same_setting(value: Any, expected: bool | int) -> bool:
    """Whether a state's setting equals this sampler's, whatever scalar type stored it."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):  # what numpy cannot read is simply not equal
        return False
    if array.ndim != 0:
        return False
    if isinstance(expected, bool):
        return array.dtype == np.bool_ and bool(array) == expected
    return array.dtype.kind in "iu" and int(array) == expected


def data_size(data: Any) -> int:
    """N from ``data``: an int, or anything with ``len()``."""
    if isinstance(data, bool | np.bool_ | str | bytes):
        kind = "boolean" if isinstance(data, bool | np.bool_) else "string"
        msg = (
            "Expected `data` to be the number of samples (an int) or an object with `len()`, "
            f"got the {kind} {data!r} instead."
        )
        raise TypeError(msg)
    try:
        n = operator.index(data)
    except TypeError:
        try:
            n = len(data)
        except TypeError:
            msg = (
                "Expected `data` to be the number of samples (an int) or an object with "
                f"`len()`, got {data!r} of type {type(data).__name__} instead."
            )
            raise TypeError(msg) from None
        if n < 1:
            msg = (
                f"Expected `data` to hold at least one sample, got an empty "
                f"{type(data).__name__} instead."
            )
            raise ValueError(msg) from None
        return n
    if n < 1:
        msg = f"Expected `data` to be a positive number of samples, got {n} instead."
        raise ValueError(msg)
    return n


def per_rank(n: int, num_replicas: int, drop_last: bool) -> int:
    """The number of samples each rank gets: ``ceil(N / W)``, or ``floor`` with drop_last."""
    return n // num_replicas if drop_last else -(-n // num_replicas)


def order_block(
    n: int, start: int, stop: int, *, seed: int, epoch: int, shuffle: bool
) -> IndexArray:
    """Entries ``[start, stop)`` of the epoch's order extended by wrapping around.

    Only this block is kept: the full permutation (when shuffling) is a temporary.
    """
    if not shuffle:
        block = np.arange(start, stop, dtype=np.int64)
        if stop > n:
            block[max(n - start, 0) :] %= n  # only the wrapped tail
        return block
    order = np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64, copy=False)
    if start == 0 and stop == n:
        return order
    if stop <= n:
        return order[start:stop].copy()  # a copy, so that the permutation can be freed
    if start >= n:  # only when N < num_replicas: a block of one entry
        return order[np.arange(start, stop, dtype=np.int64) % n]
    # the block's own part, then the wrapped padding (fewer than num_replicas entries)
    return np.concatenate([order[start:], order[np.arange(stop - n, dtype=np.int64) % n]])


def shard(
    n: int,
    num_replicas: int,
    rank: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
) -> tuple[IndexArray, MaskArray]:
    """One rank's indices and mask for one epoch; a pure function of its arguments.

    The order is ``range(N)`` or ``default_rng([seed, epoch]).permutation(N)``. Without
    ``drop_last`` it is extended to ``s * W`` entries by wrapping around (``order +
    order[:pad]``, repeating when ``pad > N``) with ``s = ceil(N / W)``, and rank ``r`` takes
    entries ``[r*s, (r+1)*s)``; the mask is False at the extended positions ``>= N``. With
    ``drop_last`` each rank takes ``floor(N / W)`` entries and the tail is dropped.
    """
    s = per_rank(n, num_replicas, drop_last)
    start, stop = rank * s, (rank + 1) * s
    indices = order_block(n, start, stop, seed=seed, epoch=epoch, shuffle=shuffle)
    mask = np.ones(s, dtype=np.bool_)
    if not drop_last and stop > n:
        mask[max(n - start, 0) :] = False
    return indices, mask
