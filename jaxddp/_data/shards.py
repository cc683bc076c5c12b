"""The pure core of :class:`jaxddp.DistributedSampler`: argument checks and one rank's shard.

Everything here is a function of plain numbers, ``(N, num_replicas, rank, seed, epoch,
shuffle, drop_last)``: no MPI, no state.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "STATE_SETTINGS",
    "IndexArray",
    "MaskArray",
    "arguments",
    "batch_count",
    "boolean",
    "check_batches_fit",
    "data_size",
    "epoch_length",
    "integer",
    "per_rank",
    "rank_entries",
    "resume_point",
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


def arguments(
    data: Any, *, num_replicas: Any, rank: Any, shuffle: Any, seed: Any, drop_last: Any
) -> tuple[int, int, int, bool, int, bool]:
    """The sampler's arguments checked: ``(N, num_replicas, rank, shuffle, seed, drop_last)``."""
    n = data_size(data)
    num_replicas = integer("num_replicas", num_replicas, minimum=1)
    rank = integer("rank", rank, minimum=0)
    if rank >= num_replicas:
        msg = (
            f"Expected `rank` to be in [0, {num_replicas}) for `num_replicas={num_replicas}`, "
            f"got {rank} instead."
        )
        raise ValueError(msg)
    shuffle = boolean("shuffle", shuffle)
    seed = integer("seed", seed, minimum=0)
    drop_last = boolean("drop_last", drop_last)
    if drop_last and n < num_replicas:
        msg = (
            f"Expected at least `num_replicas={num_replicas}` samples with `drop_last=True`, "
            f"got `data` with {n} samples instead: every rank would get nothing. Pass "
            "`drop_last=False` to pad with wrapped copies."
        )
        raise ValueError(msg)
    return n, num_replicas, rank, shuffle, seed, drop_last


def epoch_length(n: int, num_replicas: int, drop_last: bool) -> int:
    """L, the real entries of an epoch's order: N, or ``floor(N / W) * W`` with drop_last."""
    return n // num_replicas * num_replicas if drop_last else n


def check_batches_fit(batch_size: int, num_replicas: int, length: int) -> None:
    """With ``drop_last``: at least one batch of every rank fits in an epoch of ``length``."""
    if batch_size * num_replicas > length:
        msg = (
            f"Expected `batch_size` to be at most {length // num_replicas} with "
            f"`drop_last=True`, so that {num_replicas} ranks' batches fit in the "
            f"{length} samples of an epoch, got {batch_size} instead: every rank would get "
            "no batch. Pass a smaller `batch_size` or `drop_last=False`."
        )
        raise ValueError(msg)


def per_rank(n: int, num_replicas: int, drop_last: bool) -> int:
    """The number of samples each rank gets: ``ceil(N / W)``, or ``floor`` with drop_last."""
    return n // num_replicas if drop_last else -(-n // num_replicas)


def rank_entries(
    n: int,
    num_replicas: int,
    rank: int,
    start: int,
    stop: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
) -> tuple[IndexArray, MaskArray]:
    """Entries ``[start, stop)`` of one rank, with their mask; a pure function of its arguments.

    The epoch's order is ``range(N)`` or ``default_rng([seed, epoch]).permutation(N)``, of
    which the first ``L`` entries are kept (see :func:`epoch_length`). The *padded order*
    repeats them without end: position ``g`` holds ``order[g % L]``, real (mask True)
    exactly when ``g < L``. Rank ``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...``:
    its entry ``j`` is position ``j * W + r``. So the ranks' entries ``j`` for ``j`` in
    ``[k*B, (k+1)*B)``, interleaved, are positions ``[k*W*B, (k+1)*W*B)``: one process's
    batch ``k`` of size ``W * B``, padding included. Only the entries asked for are kept: the
    permutation (when shuffling) is a temporary.
    """
    length = epoch_length(n, num_replicas, drop_last)
    count = max(stop - start, 0)
    first = start * num_replicas + rank  # the position of entry `start`
    real = min(max(-(-(length - first) // num_replicas), 0), count)  # entries with g < L
    mask = np.zeros(count, dtype=np.bool_)
    mask[:real] = True
    # the positions past L, whose indices wrap around (fewer than W of the shard's own)
    wrapped = (first + num_replicas * np.arange(real, count, dtype=np.int64)) % length
    if not shuffle:
        head = np.arange(first, first + real * num_replicas, num_replicas, dtype=np.int64)
        return np.concatenate([head, wrapped]), mask
    order = np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64, copy=False)
    head = order[first : first + real * num_replicas : num_replicas]
    if real == count:
        # a copy, so that the permutation can be freed (unless the head is all of it)
        return (head if head.size == n else head.copy()), mask
    return np.concatenate([head, order[wrapped]]), mask


def shard(
    n: int,
    num_replicas: int,
    rank: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
    extra: int = 0,
) -> tuple[IndexArray, MaskArray]:
    """One rank's indices and mask for one epoch, and ``extra`` entries past its end.

    The rank's ``ceil(L / W)`` entries of the padded order (see :func:`rank_entries`), or
    ``floor(N / W)`` with ``drop_last``; the mask is False exactly at the wrapped positions
    ``>= L``. The ``extra`` entries continue the padded order: the fill of a short last batch.
    """
    s = per_rank(n, num_replicas, drop_last)
    return rank_entries(
        n,
        num_replicas,
        rank,
        0,
        s + extra,
        seed=seed,
        epoch=epoch,
        shuffle=shuffle,
        drop_last=drop_last,
    )


# Keys of a state dict besides "epoch" and "position": a state only fits a sampler that
# agrees on all of them. The world size is not one: a position is one in the global order.
STATE_SETTINGS = ("data_size", "seed", "shuffle", "drop_last")


def resume_point(
    state: Any,
    *,
    n: int,
    num_replicas: int,
    seed: int,
    shuffle: bool,
    drop_last: bool,
) -> tuple[int, int]:
    """``(epoch, position)`` of a state that a sampler with these settings can continue.

    ``position`` counts the samples of the epoch's global order handed out, ``N`` once the
    epoch is done. ``W`` ranks continue together from a position only if it is a multiple
    of ``W`` (each rank then starts at its entry ``position / W``), or if nothing is left at
    this world size (``position >= L``, returned as ``N``). Raises TypeError or ValueError
    naming what does not fit.
    """
    if not isinstance(state, Mapping):
        msg = (
            "Expected `state` to be a dict from `DistributedSampler.state_dict()`, "
            f"got {type(state).__name__} instead."
        )
        raise TypeError(msg)
    if "num_replicas" in state:
        msg = (
            "Expected `state` to be a dict from `DistributedSampler.state_dict()` of this "
            "jaxddp, got one with `num_replicas` instead: it was saved by a jaxddp that gave "
            "each rank a contiguous block, and its `position` counts one rank's samples of "
            "that block, which is no position in today's interleaved order. Restart its "
            "epoch: load `{**state, 'position': 0}` without the `num_replicas` key."
        )
        raise ValueError(msg)
    missing = [k for k in ("epoch", "position", *STATE_SETTINGS) if k not in state]
    if missing:
        msg = (
            "Expected `state` to be a dict from `DistributedSampler.state_dict()`, "
            f"got one without {', '.join(map(repr, missing))} instead."
        )
        raise ValueError(msg)
    mine = {"data_size": n, "seed": seed, "shuffle": shuffle, "drop_last": drop_last}
    for key in STATE_SETTINGS:
        if not same_setting(state[key], mine[key]):
            msg = (
                f"Expected a state with `{key}={mine[key]!r}` like this sampler's, got "
                f"`{key}={state[key]!r}` instead: a position only makes sense in the "
                "order it was taken from. Build the sampler with the same arguments as "
                "the run that saved the state (any number of ranks)."
            )
            raise ValueError(msg)
    epoch = integer("state['epoch']", state["epoch"], minimum=0)
    position = integer("state['position']", state["position"], minimum=0)
    if position > n:
        msg = (
            f"Expected `state['position']` to be at most the {n} samples of an epoch, got "
            f"{position} instead."
        )
        raise ValueError(msg)
    if position >= epoch_length(n, num_replicas, drop_last):
        return epoch, n  # nothing of the epoch left at this world size
    if position % num_replicas:
        below = position - position % num_replicas
        msg = (
            f"Expected `state['position']` to be a multiple of `num_replicas={num_replicas}`, "
            f"got {position} instead: the state was saved after {position} samples of epoch "
            f"{epoch}, and {num_replicas} ranks, which each take one sample in {num_replicas}, "
            "cannot all continue from there. Resume on a number of ranks that divides "
            f"{position} (the saving run's number does), or load "
            f"`{{**state, 'position': {below}}}` to see {position - below} samples again."
        )
        raise ValueError(msg)
    return epoch, position


def batch_count(
    n: int, num_replicas: int, start: int, batch_size: int, *, drop_last: bool, drop_short: bool
) -> int:
    """How many batches each rank yields from its entry ``start`` on.

    ``ceil((s - start) / B)`` with ``s = per_rank(...)``: the short last batch is filled
    with the padded order. With ``drop_short``, only batches whose ``W * B`` positions are
    all real: ``floor((L - start * W) / (W * B))``, as one process with batch ``W * B`` has.
    """
    if drop_short:
        left = epoch_length(n, num_replicas, drop_last) - start * num_replicas
        return max(left, 0) // (num_replicas * batch_size)
    left = per_rank(n, num_replicas, drop_last) - start
    return -(-max(left, 0) // batch_size)
