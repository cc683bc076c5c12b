"""The collectives of sharded state: ``reduce_scatter`` and ``all_gather`` on pytrees.

What a ZeRO or FSDP step needs besides an allreduce: each rank keeps one block of a
gradient, reduced over the ranks (``reduce_scatter``), and gets every rank's block of the
parameters back (``all_gather``). Their shapes follow ``jax.lax.psum_scatter`` and
``jax.lax.all_gather`` along the leading axis, ``tiled`` as there.

Through MPI (inside ``jax.jit`` with jaxddp's alltoall and allgather, outside it with
mpi4py) a reduce-scatter is an alltoall of the blocks, then a sum in rank order on each
rank: it moves what an allreduce's first half moves ((W - 1) / W of the leaf per rank,
against about twice that for an allreduce then a slice), computes a W-th of the sum, and the sum's
bits are the same inside and outside ``jax.jit``. Inside ``jaxddp.spmd`` with
``JAXDDP_COLLECTIVES=xla`` they are JAX's ``psum_scatter`` and ``all_gather``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from .._types import Communicator, PyTree
from . import dtypes as _dtypes
from ._jax import ops
from .api import agreed, mpi_op_of
from .checks import check_reducible, is_number_or_array, leaf_path
from .dtypes import is_key_dtype
from .wire import chunks, from_wire, plan, to_wire

__all__ = ["all_gather", "reduce_scatter"]

SCATTER_OPS = ("sum", "mean")


def reduce_scatter(
    tree: PyTree,
    op: Literal["sum", "mean"] = "sum",
    *,
    tiled: bool = False,
    comm: Communicator | None = None,
) -> Any:
    """Reduces every leaf over the ranks and gives rank ``r`` its ``r``-th block of the result.

    Each leaf's leading axis is cut into ``W`` (the world size) equal blocks; rank ``r``
    gets block ``r`` of the sum (or mean) of every rank's leaf, as ``jax.lax.psum_scatter``
    over the ranks' axis with ``scatter_dimension=0``. With ``tiled=False`` (as in JAX) the
    leading axis must be ``W`` and is removed: ``(W, *rest)`` gives ``rest``. With
    ``tiled=True`` it must be a multiple of ``W`` and is kept: ``(W * k, *rest)`` gives
    ``(k, *rest)``. :func:`all_gather` with the same ``tiled`` puts the blocks back together.

    Through MPI the blocks travel in one alltoall (leaves of one dtype share it) and each
    rank adds the ``W`` blocks it got in rank order, ``((x_0 + x_1) + x_2) + ...``: the sum
    is the same to the bit inside and outside ``jax.jit`` (a mean divides it as XLA or
    NumPy divides, which may differ in the last bit where ``W`` is not a power of two).
    Inside ``jaxddp.spmd`` with ``JAXDDP_COLLECTIVES=xla`` it is ``psum_scatter``, whose
    floating-point sums XLA orders itself: equal to the MPI path to rounding (exactly for
    integers and booleans).

    Every rank must pass a tree of the same structure, shapes and dtypes and the same
    ``op``; the ranks check that first, as :func:`allreduce` does, and then every rank
    raises the same error for a leaf it cannot scatter, before anything is sent. Works
    inside and outside ``jax.jit`` (concrete values travel through mpi4py and come back as
    NumPy arrays); it has no derivative on the MPI path.

    Args:
      tree: a pytree of arrays. The dtype rules are :func:`allreduce`'s: bfloat16 and
        float16 are summed in float32 and rounded once; ``"mean"`` of integers is float32,
        summed without overflow; booleans give their int32 count (``"sum"``) or float32
        fraction (``"mean"``). Typed PRNG keys, strings and other objects are refused
        (TypeError), and so is a leaf with no leading axis or one that does not divide into
        ``W`` blocks (ValueError).
      op: ``"sum"`` or ``"mean"`` (the sum divided by the world size).
      tiled: keep the leading axis (``True``: its length divided by ``W``) or remove it
        (``False``: it must be ``W``), as in ``jax.lax.psum_scatter``.
      comm: an mpi4py communicator to reduce over; by default ``COMM_WORLD``.

    Returns:
      A pytree of the same structure holding this rank's block of each reduced leaf: jax
      arrays inside ``jax.jit``, NumPy arrays outside.

    Example:
      >>> import jax, jax.numpy as jnp, jaxddp
      >>> w = jaxddp.world_size()
      >>> grads = {"w": jnp.ones((2 * w, 3))}
      >>> mine = jax.jit(lambda g: jaxddp.reduce_scatter(g, "sum", tiled=True))(grads)
      >>> mine["w"].shape, float(mine["w"][0, 0]) == w
      ((2, 3), True)
    """
    _, size, (jax_comm, host_comm), (leaves, treedef), concrete = agreed(
        tree, comm, "reduce_scatter", op=op
    )
    if op not in SCATTER_OPS:
        msg = (
            f"Expected `op` of `reduce_scatter` to be 'sum' or 'mean', got {op!r} instead. "
            "For 'max' or 'min', take your block of `jaxddp.allreduce(tree, op)`."
        )
        raise ValueError(msg)
    check_reducible(tree, leaves, op, "reduce_scatter")
    for i, leaf in enumerate(leaves):
        _check_blocks(np.shape(leaf), size, tiled, "reduce_scatter", leaf_path(tree, i))
    arrays = [np.asarray(x) if concrete else jnp.asarray(x) for x in leaves]
    dtypes = [x.dtype for x in arrays]
    wide = []
    for x in arrays:
        w = _dtypes.widen(x.reshape(size, x.size // size), op)
        if w.ndim == 3:  # an integer mean's (high, low) halves: each rank's block, whole
            w = jnp.moveaxis(w, 0, 1).reshape(size, 2 * (x.size // size))
        wide.append(w)
    if size == 1:
        summed = [w[0] for w in wide]
    elif concrete:
        moved = _packed(wide, lambda bs: _alltoall(bs, host_comm), size)
        summed = [ops.sum_rows(r) for r in moved]
    else:
        mpi_op = mpi_op_of(op)

        def scatter(buffers: list[Any]) -> list[Any]:
            return [x[None] for x in ops.reduce_scatter_many(buffers, mpi_op, jax_comm)]

        summed = [r[0] for r in _packed(wide, scatter, 1)]
    out = []
    for x, total, dtype in zip(arrays, summed, dtypes, strict=True):
        block = (x.shape[0] // size, *x.shape[1:]) if tiled else x.shape[1:]
        out.append(
            _dtypes.narrow(_finish(total, dtype, op, size, concrete), dtype, op).reshape(block)
        )
    return jax.tree_util.tree_unflatten(treedef, out)


def all_gather(tree: PyTree, *, tiled: bool = False, comm: Communicator | None = None) -> Any:
    """Gives every rank every rank's values of every leaf, in rank order.

    As ``jax.lax.all_gather`` over the ranks' axis with ``axis=0``: with ``tiled=False`` (as
    in JAX) each leaf of shape ``s`` becomes ``(W, *s)``, row ``r`` holding rank ``r``'s
    leaf; with ``tiled=True`` the ranks' leaves are joined along their leading axis,
    ``(k, *rest)`` giving ``(W * k, *rest)``. It undoes :func:`reduce_scatter` with the same
    ``tiled``. Every value arrives bit for bit (bfloat16, a NaN's payload, a negative zero);
    dtypes are kept, booleans included, and typed PRNG keys travel as their key data and
    come back as keys.

    Through MPI the leaves of one dtype travel in one allgather; inside ``jaxddp.spmd`` with
    ``JAXDDP_COLLECTIVES=xla`` it is JAX's ``all_gather``. Every rank must pass a tree of the
    same structure, shapes and dtypes (checked first, as :func:`allreduce` does). Works
    inside and outside ``jax.jit``; outside it the values travel through mpi4py and come
    back as NumPy arrays. It has no derivative on the MPI path.

    Args:
      tree: a pytree of arrays and numbers (a Python number is a 0-d array of its NumPy
        dtype outside ``jax.jit``, of JAX's inside). Strings and other objects are refused
        (TypeError), and so is a 0-d leaf with ``tiled=True`` (ValueError), before anything
        is sent.
      tiled: join along the leading axis (``True``) or stack on a new one (``False``), as in
        ``jax.lax.all_gather``.
      comm: an mpi4py communicator to gather over; by default ``COMM_WORLD``.

    Returns:
      A pytree of the same structure, identical on every rank: jax arrays inside
      ``jax.jit``, NumPy arrays outside (keys as keys).

    Example:
      >>> import jax, jax.numpy as jnp, jaxddp
      >>> everyone = jax.jit(jaxddp.all_gather)({"r": jnp.int32(jaxddp.rank())})
      >>> everyone["r"].tolist() == list(range(jaxddp.world_size()))
      True
    """
    _, size, (jax_comm, host_comm), (leaves, treedef), concrete = agreed(tree, comm, "all_gather")
    for i, leaf in enumerate(leaves):
        if not is_number_or_array(leaf):
            msg = (
                f"`all_gather` got a {type(leaf).__name__} at `{leaf_path(tree, i)}`, which "
                "is not an array or a number. Leave it out of the tree, or gather other "
                "objects with mpi4py's lowercase `comm.allgather`."
            )
            raise TypeError(msg)
        if tiled:
            _check_blocks(np.shape(leaf), 1, tiled, "all_gather", leaf_path(tree, i))
    keys = [is_key_dtype(_dtypes.leaf_dtype(x)) for x in leaves]
    arrays = [jax.random.key_data(x) if k else x for x, k in zip(leaves, keys, strict=True)]
    arrays = [np.asarray(x) if concrete else jnp.asarray(x) for x in arrays]
    wire = [to_wire(x, arithmetic=False).reshape(1, x.size) for x in arrays]
    if size == 1:
        rows = wire
    elif concrete:
        rows = _packed(wire, lambda bs: _allgather(bs, host_comm), size)
    else:
        rows = _packed(wire, lambda bs: ops.allgather_many([b[0] for b in bs], jax_comm), size)
    out = []
    for leaf, x, r, key in zip(leaves, arrays, rows, keys, strict=True):
        got = from_wire(r, x.dtype, arithmetic=False).reshape(size, *x.shape)
        if tiled:
            got = got.reshape(size * x.shape[0], *x.shape[1:])
        if key:
            got = jax.random.wrap_key_data(jnp.asarray(got), impl=jax.random.key_impl(leaf))
        out.append(got)
    return jax.tree_util.tree_unflatten(treedef, out)


def _finish(total: Any, dtype: Any, op: str, size: int, concrete: bool) -> Any:
    """A rank's summed block, divided by the world size for a mean (an integer mean's
    carrier, ``(high, low)`` halves inside ``jax.jit``, as :func:`_dtypes.mean` takes it)."""
    if op != "mean":
        return total
    if _dtypes.halves(dtype, traced=not concrete):
        total = total.reshape(2, -1)
    return _dtypes.mean(total, size, dtype)


def _check_blocks(shape: tuple[int, ...], size: int, tiled: bool, call: str, path: str) -> None:
    """Raises ValueError, naming the leaf and the fix, for a leaf whose leading axis does not
    make ``size`` blocks (``tiled``: any multiple of ``size``; else exactly ``size``)."""
    if not shape:
        msg = (
            f"`{call}` got a 0-d leaf at `{path}`, which has no leading axis to "
            f"{'scatter' if call == 'reduce_scatter' else 'join'}. Expected arrays of at "
            "least one dimension; give the leaf a leading axis (`x[None]`)"
            + (" or pass `tiled=False`." if call == "all_gather" else ".")
        )
        raise ValueError(msg)
    if tiled and shape[0] % size:
        msg = (
            f"`{call}` with tiled=True got a leaf of shape {shape} at `{path}`, whose leading "
            f"axis ({shape[0]}) does not divide into {size} equal blocks, one per rank. "
            f"Expected a multiple of the world size ({size}); pad the leaf to "
            f"{-(-shape[0] // size) * size} rows, or move another axis first (`jnp.moveaxis`)."
        )
        raise ValueError(msg)
    if not tiled and shape[0] != size:
        msg = (
            f"`{call}` with tiled=False got a leaf of shape {shape} at `{path}`, whose leading "
            f"axis ({shape[0]}) is not the world size ({size}): rank r gets row r of the "
            "reduction, one row per rank. Pass `tiled=True` to cut a longer axis into "
            f"{size} blocks, or reshape the leaf to ({size}, ...)."
        )
        raise ValueError(msg)


def _alltoall(buffers: list[np.ndarray], comm: Communicator) -> list[np.ndarray]:
    """Row ``j`` of each ``(size, c)`` NumPy buffer to rank ``j``, row ``i`` from rank ``i``."""
    out = []
    for b in buffers:
        send = np.ascontiguousarray(b)
        recv = np.empty_like(send)
        comm.Alltoall(send, recv)
        out.append(recv)
    return out


def _allgather(buffers: list[np.ndarray], comm: Communicator) -> list[np.ndarray]:
    """Every rank's row of each ``(1, c)`` NumPy buffer, as ``(size, c)``, in rank order."""
    out = []
    for b in buffers:
        send = np.ascontiguousarray(b[0])
        recv = np.empty((comm.Get_size(), send.size), send.dtype)
        comm.Allgather(send, recv)
        out.append(recv)
    return out


def _packed(rows: list[Any], move: Callable[[list[Any]], list[Any]], height: int) -> list[Any]:
    """``move`` on the ``(R, m_i)`` arrays ``rows``, packed: leaves of one dtype share a
    buffer as :func:`jaxddp._collectives.wire.plan` groups them (joined along their columns),
    and a buffer of more columns than an MPI count holds goes in chunks of columns. ``move``
    takes the buffers and returns each as ``(height, columns)``; the columns are cut back into
    one array per leaf. Empty leaves are not sent."""
    xp = np if all(isinstance(r, np.ndarray) for r in rows) else jnp
    groups = plan(rows)
    buffers = [
        rows[g[0]] if len(g) == 1 else xp.concatenate([rows[i] for i in g], axis=1) for g in groups
    ]
    spans = [chunks(b.shape[1]) for b in buffers]
    pieces = [
        b if len(s) == 1 else b[:, i:j] for b, s in zip(buffers, spans, strict=True) for i, j in s
    ]
    moved = iter(move(pieces) if pieces else [])
    out: list[Any] = [None] * len(rows)
    for group, s in zip(groups, spans, strict=True):
        parts = [next(moved) for _ in s]
        flat = parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=1)
        offset = 0
        for i in group:
            out[i] = flat[:, offset : offset + rows[i].shape[1]]
            offset += rows[i].shape[1]
    for i, r in enumerate(rows):
        if out[i] is None:  # an empty leaf
            out[i] = xp.zeros((height, r.shape[1]), r.dtype)
    return out
