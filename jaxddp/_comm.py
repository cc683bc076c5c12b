"""The pytree collectives: allreduce, broadcast and reduce, inside and outside ``jax.jit``.

The world itself (start-up, rank and size, the private communicators) lives in
:mod:`jaxddp._world`; its functions are re-exported here so that call sites keep working.
mpi4jax is imported only through :func:`mpi4jax`, after MPI has been initialized.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._world import init, jax_comm, local_rank, mpi, mpi4jax, py_comm, rank, world_size

__all__ = [
    "allreduce",
    "broadcast",
    "init",
    "jax_comm",
    "local_rank",
    "mpi",
    "mpi4jax",
    "py_comm",
    "rank",
    "reduce",
    "world_size",
]

_OPS = ("sum", "mean", "max", "min")


def _mpi_op(op: str) -> Any:
    MPI = mpi()
    return {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]


def check_op(op: str) -> str:
    """Validates a reduction name; returns it."""
    if op not in _OPS:
        msg = f"Expected `op` to be one of {', '.join(map(repr, _OPS))}, got {op!r} instead."
        raise ValueError(msg)
    return op


def check_root(root: int, size: int) -> int:
    """Validates a root rank against the world size; returns it."""
    if isinstance(root, bool) or not isinstance(root, int | np.integer) or not 0 <= root < size:
        msg = f"Expected `root` to be a rank in [0, {size}), got {root!r} instead."
        raise ValueError(msg)
    return int(root)


# Leaves of at least this many bytes travel alone; smaller ones of one dtype are packed into
# flat buckets of up to _BUCKET_BYTES, so that a tree of many small leaves costs a few MPI
# calls instead of one per leaf, and large leaves are never copied into a bucket.
# (Chosen from measurements: see benchmarks/.)
_ALONE_BYTES = 1 << 20
_BUCKET_BYTES = 4 << 20


def _plan(leaves: list[jax.Array]) -> list[list[int]]:
    """Groups leaf indices into MPI calls: one per large leaf, one per bucket of small ones.

    Depends only on shapes and dtypes, so it is the same on every rank whose tree matches.
    Empty leaves need no call and are left out.
    """
    groups: list[list[int]] = []
    open_bucket: dict[Any, tuple[list[int], int]] = {}
    for i, leaf in enumerate(leaves):
        nbytes = leaf.size * leaf.dtype.itemsize
        if leaf.size == 0:
            continue
        if nbytes >= _ALONE_BYTES:
            groups.append([i])
            continue
        bucket, filled = open_bucket.get(leaf.dtype, ([], 0))
        if bucket and filled + nbytes > _BUCKET_BYTES:
            groups.append(bucket)
            bucket, filled = [], 0
        bucket.append(i)
        open_bucket[leaf.dtype] = (bucket, filled + nbytes)
    groups.extend(bucket for bucket, _ in open_bucket.values())
    return groups


# dtypes MPI (and mpi4jax) can carry as they are.
_MPI_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        "float32", "float64", "complex64", "complex128", "bool",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    )
)  # fmt: skip
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _to_wire(x: jax.Array, arithmetic: bool) -> jax.Array:
    """A dtype MPI knows: bfloat16, float16 and the like are reduced in float32 (exact for
    max and min, more accurate for sums) and moved bit for bit when nothing is computed."""
    if x.dtype in _MPI_DTYPES:
        return x
    if arithmetic:
        return x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int64)
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize])


def _from_wire(x: jax.Array, like: jax.Array, arithmetic: bool) -> jax.Array:
    if x.dtype == like.dtype:
        return x
    if arithmetic:
        return x.astype(like.dtype)
    return jax.lax.bitcast_convert_type(x, like.dtype)


def _fused(leaves: list[jax.Array], collective: Any, *, arithmetic: bool) -> list[jax.Array]:
    """Applies an elementwise collective to every leaf, in as few calls as :func:`_plan` says.

    ``arithmetic`` says whether the collective computes on the values (a reduction) or only
    moves them (a broadcast); it decides how dtypes unknown to MPI travel.
    """
    wire = [_to_wire(x, arithmetic) for x in leaves]
    out: list[Any] = list(wire)  # empty leaves stay as they are
    for group in _plan(wire):
        if len(group) == 1:
            (i,) = group
            out[i] = collective(wire[i])
            continue
        flat = collective(jnp.concatenate([wire[i].ravel() for i in group]))
        offset = 0
        for i in group:
            n = wire[i].size
            out[i] = flat[offset : offset + n].reshape(wire[i].shape)
            offset += n
    return [_from_wire(x, like, arithmetic) for x, like in zip(out, leaves, strict=True)]


def _world_and_comm(comm: Any) -> tuple[int, int, Any]:
    """(rank, size, communicator for mpi4jax) for a user's communicator or jaxddp's own."""
    if comm is None:
        world = init()
        return world.rank, world.size, world.jax_comm
    init()
    return comm.Get_rank(), comm.Get_size(), comm


def allreduce(tree: Any, op: str = "mean", *, comm: Any = None) -> Any:
    """Reduces every leaf of a pytree across all ranks; usable inside and outside ``jax.jit``.

    Small leaves of one dtype travel together in a few flat buffers; large leaves travel
    alone. Every rank must call it with a tree of the same structure, shapes and dtypes.

    Args:
      tree: a pytree of arrays or numbers. Shapes and dtypes are kept, except that
        ``"mean"`` of an integer leaf is a float32 leaf, as with ``jnp.mean``.
      op: ``"sum"``, ``"mean"`` (sum divided by the world size), ``"max"`` or ``"min"``.
      comm: an mpi4py communicator to reduce over; by default jaxddp's private clone of
        ``COMM_WORLD``. Do not use the same communicator for mpi4py calls.

    Returns:
      A pytree of the same structure holding the reduced values, identical on every rank.

    Example:
      >>> import jax, jax.numpy as jnp, jaxddp
      >>> tree = {"w": jnp.ones(3), "step": jnp.int32(2)}
      >>> out = jax.jit(lambda t: jaxddp.allreduce(t, op="sum"))(tree)
      >>> out["w"].tolist() == [float(jaxddp.world_size())] * 3
      True
    """
    check_op(op)
    _, size, comm = _world_and_comm(comm)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [jnp.asarray(x) for x in leaves]
    if size > 1:
        mpi_op = _mpi_op(op)
        m = mpi4jax()
        leaves = _fused(leaves, lambda x: m.allreduce(x, mpi_op, comm=comm), arithmetic=True)
    if op == "mean":
        leaves = [
            x / size if jnp.issubdtype(x.dtype, jnp.inexact) else x / np.float32(size)
            for x in leaves
        ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)  # pyright: ignore[reportAttributeAccessIssue]


def _is_number_or_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | complex)


def _rooted(tree: Any, root: int, comm: Any, collective: Any, *, arithmetic: bool) -> Any:
    """Applies a rooted collective to the array and number leaves; others pass unchanged."""
    _, size, comm = _world_and_comm(comm)
    check_root(root, size)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    picked = [i for i, leaf in enumerate(leaves) if _is_number_or_array(leaf)]
    if size > 1 and picked:
        m = mpi4jax()
        done = _fused(
            [jnp.asarray(leaves[i]) for i in picked],
            collective(m, root, comm),
            arithmetic=arithmetic,
        )
        for i, new in zip(picked, done, strict=True):
            old = leaves[i]
            if isinstance(old, int | float | complex) and _is_concrete(new):
                new = type(old)(new.item())  # noqa: PLW2901 - a number stays a number
            leaves[i] = new
    return jax.tree_util.tree_unflatten(treedef, leaves)


def broadcast(tree: Any, root: int = 0, *, comm: Any = None) -> Any:
    """Gives every rank ``root``'s values of every array and number leaf.

    Leaves that are neither arrays nor numbers (strings, callables, ...) are returned
    unchanged. Every rank must pass a tree of the same structure, shapes and dtypes; use
    :func:`jaxddp.synchronize` to have that checked first. Works inside ``jax.jit``.

    Example:
      >>> import jax.numpy as jnp, jaxddp
      >>> state = {"params": jnp.arange(3.0), "name": "mlp", "step": 5}
      >>> jaxddp.broadcast(state, root=0)["name"]
      'mlp'
    """
    return _rooted(
        tree, root, comm, lambda m, r, c: lambda x: m.bcast(x, r, comm=c), arithmetic=False
    )


def reduce(tree: Any, op: str, root: int = 0, *, comm: Any = None) -> Any:
    """Reduces every array and number leaf onto ``root``.

    On ``root`` the leaves hold the reduction (``"mean"`` divides the sum by the world
    size); on the other ranks they are returned as they were passed. Other leaves are
    returned unchanged.

    Example:
      >>> import jax.numpy as jnp, jaxddp
      >>> total = jaxddp.reduce({"loss": jnp.float32(2.0)}, "sum", root=0)
      >>> float(total["loss"]) == 2.0 * jaxddp.world_size()
      True
    """
    check_op(op)
    mpi_op = _mpi_op(op)
    out = _rooted(
        tree,
        root,
        comm,
        lambda m, r, c: lambda x: m.reduce(x, mpi_op, r, comm=c),
        arithmetic=True,
    )
    rank, size, _ = _world_and_comm(comm)
    if op != "mean" or rank != root:
        return out
    return jax.tree_util.tree_map(lambda x: x / size if _is_number_or_array(x) else x, out)
