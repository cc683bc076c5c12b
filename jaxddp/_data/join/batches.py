"""One batch of a rank's stream: flattened, checked, described, padded (no MPI here)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["Batch", "StreamError", "describe_difference", "flatten", "fresh", "own", "pad", "paths"]


class StreamError(Exception):
    """A problem of this rank's batch that every rank raises, as ``kind``."""

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Batch:
    """One batch read from the stream, flattened: its leaves, structure and real rows."""

    __slots__ = ("leaves", "mask", "rows", "treedef")

    def __init__(self, leaves: list[Any], treedef: Any, rows: int, mask: Any) -> None:
        self.leaves, self.treedef, self.rows, self.mask = leaves, treedef, rows, mask

    def kinds(self) -> tuple[tuple[Any, tuple[int, ...]], ...]:
        """Each leaf's dtype and trailing shape: what every batch of every rank shares."""
        return tuple((leaf.dtype, leaf.shape[1:]) for leaf in self.leaves)

    def describe(self) -> tuple[str, list[tuple[str, str]]]:
        """The same as text: the tree and each leaf's ``dtype[*,trailing shape]`` (``*``:
        the batch axis, which may differ)."""
        kinds = [_kind(dtype, shape) for dtype, shape in self.kinds()]
        return str(self.treedef), list(zip(paths(self.treedef), kinds, strict=True))

    def padded(self, size: int) -> list[Any]:
        """The leaves with ``size`` rows: the real ones, then repeats of them."""
        if self.rows == size:
            return self.leaves
        rows = np.arange(size) % self.rows if self.rows else None
        return [pad(leaf, rows, size) for leaf in self.leaves]


def _kind(dtype: Any, shape: tuple[int, ...]) -> str:
    return f"{np.dtype(dtype).name}[{','.join(['*', *map(str, shape)])}]"


def paths(treedef: Any) -> list[str]:
    """Each leaf's path in a tree of structure ``treedef``, as ``jax.tree_util.keystr``."""
    dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    flat, _ = jax.tree_util.tree_flatten_with_path(dummy)
    return [jax.tree_util.keystr(path) for path, _ in flat]


def pad(leaf: Any, rows: np.ndarray | None, size: int) -> Any:
    """``leaf``'s rows at ``rows`` (``size`` zero rows when it has none): padding made of
    real values, so that a loss on the padding rows stays finite."""
    if rows is None:
        return np.zeros((size, *leaf.shape[1:]), leaf.dtype)
    return leaf[rows]


def own(leaf: Any) -> np.ndarray:
    """A NumPy array of ``leaf``'s values that nothing else can change: always a copy. A
    stream may yield one buffer (or views of it) refilled at every batch, and join reads
    ahead: what it holds, and what it hands out, must be its own."""
    return np.array(np.asarray(leaf), copy=True)


def fresh(leaves: list[Any]) -> list[Any]:
    """Copies of ``leaves`` (NumPy or JAX arrays), never handed out before: a step may have
    donated the arrays it was given."""
    return [leaf.copy() for leaf in leaves]


def flatten(item: Any, masked: bool) -> Batch:
    """This rank's item as a :class:`Batch`, or a :class:`StreamError` saying why not.
    Leaves that are not JAX arrays become NumPy arrays of their own (:func:`own`); JAX
    arrays, which nothing changes, are kept."""
    mask = None
    if masked:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise StreamError(
                TypeError,
                f"Expected `(batch, mask)` pairs from the stream (`masked=True`), got a "
                f"{type(item).__name__} instead. Pass `masked=False` for a stream of batches.",
            )
        item, mask = item
    leaves, treedef = jax.tree_util.tree_flatten(item)
    if not leaves:
        raise StreamError(
            ValueError,
            f"Expected a batch with at least one array, got {item!r} instead: a batch is a "
            "pytree of arrays with a leading batch axis.",
        )
    leaves = [leaf if isinstance(leaf, jax.Array) else own(leaf) for leaf in leaves]
    n = leaves[0].shape[0] if leaves[0].ndim else None
    if n is None or any(not leaf.ndim or leaf.shape[0] != n for leaf in leaves):
        shapes = ", ".join(
            f"`{p}` {tuple(leaf.shape)}" for p, leaf in zip(paths(treedef), leaves, strict=True)
        )
        raise StreamError(
            ValueError,
            f"Expected every leaf of a batch to have the same leading (batch) axis, got "
            f"{shapes} instead. Give every leaf one row per sample.",
        )
    if mask is not None:
        mask = own(mask)
        if mask.dtype != np.bool_ or mask.shape != (n,):
            raise StreamError(
                ValueError,
                f"Expected the mask of a `(batch, mask)` pair to be a bool array of shape "
                f"({n},), one entry per row, got {mask.dtype}{list(mask.shape)} instead.",
            )
    return Batch(leaves, treedef, n, mask)


def describe_difference(
    rank: int, mine: tuple[str, list[Any]], agreed: tuple[str, list[Any]], other: str
) -> str:
    """``rank``'s batch structure against ``other``'s: the first differing leaf first."""
    (tree, leaves), (agreed_tree, agreed_leaves) = mine, agreed
    theirs, ours = dict(agreed_leaves), dict(leaves)
    for path in [p for p, _ in agreed_leaves] + [p for p, _ in leaves]:
        if theirs.get(path) != ours.get(path):
            return (
                f"rank {rank}'s batch has {ours.get(path, 'nothing')} at `{path}` where "
                f"{other} has {theirs.get(path, 'nothing')}"
            )
    return f"rank {rank}'s batch is the tree {tree} where {other} has {agreed_tree}"
