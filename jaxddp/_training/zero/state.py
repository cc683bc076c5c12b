"""The state of :func:`jaxddp.shard_optimizer`, each rank's own: what a checkpoint saves per
rank. Apart from the optimizer, so that other per-rank state (the error feedback of a
compressed allreduce) can be kept in it without importing the optimizer."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

__all__ = ["ShardedState", "Slicing"]


@dataclasses.dataclass(frozen=True)
class Slicing:
    """How a :class:`ShardedState` is cut, the same on every rank (never the rank): what a
    checkpoint needs to save each rank's slices and to cut them anew at another world size.

    Attributes:
      lengths: the real number of elements ``L_g`` of each dtype group's packed vector.
      size: the world size ``W``: each rank holds ``ceil(L_g / W)`` elements of group ``g``.
      groups: for each leaf of ``inner``'s state, in flatten order, the group whose slice
        it is, or -1 for a leaf held whole by every rank (adam's step count).
    """

    lengths: tuple[int, ...]
    size: int
    groups: tuple[int, ...]


class ShardedState:
    """The state of :func:`shard_optimizer`: ``inner``'s state for this rank's slice of the
    packed parameters (a tuple of 1-D arrays, one per parameter dtype, where ``inner.init``
    would have had the parameters' tree). It differs from rank to rank.
    :class:`jaxddp.CheckpointManager` saves it as it is, each rank its own slices, and
    restores it into ``tx.init(params)`` at any world size; :meth:`ShardedOptimizer.gather_state`
    gives the full state (the unsharded optimizer's), :meth:`ShardedOptimizer.shard_state`
    this rank's share of one.

    A pytree with one child, ``inner``; its ``slicing`` (a :class:`Slicing`, set by
    ``init`` and ``update``) is static: part of the tree's structure, equal on every rank
    and from step to step."""

    __slots__ = ("inner", "slicing")
    inner: Any
    slicing: Slicing | None

    def __init__(self, inner: Any, slicing: Slicing | None = None) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "slicing", slicing)

    def __setattr__(self, name: str, value: Any) -> None:
        msg = "A ShardedState is immutable: build another one."
        raise AttributeError(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        return ShardedState, (self.inner, self.slicing)

    def __repr__(self) -> str:
        return f"ShardedState(inner={self.inner!r}, slicing={self.slicing!r})"


def _unflatten(slicing: Slicing | None, children: Any) -> ShardedState:
    (inner,) = children
    return ShardedState(inner, slicing)


jax.tree_util.register_pytree_with_keys(
    ShardedState,
    lambda s: (((jax.tree_util.GetAttrKey("inner"), s.inner),), s.slicing),
    _unflatten,
    flatten_func=lambda s: ((s.inner,), s.slicing),
)
