"""The pytree collectives: allreduce, broadcast and reduce, inside and outside ``jax.jit``.

The world itself (start-up, rank and size, the private communicators) lives in
:mod:`jaxddp._world`; its functions are re-exported here so that call sites keep working.
mpi4jax is imported only through :func:`mpi4jax`, after MPI has been initialized.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _host, _primitive, _progress
from ._buckets import plan, split, wire_dtype
from ._world import (
    init,
    jax_comm,
    local_rank,
    mpi,
    mpi4jax,
    private_comms,
    py_comm,
    rank,
    world_size,
)

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


@functools.cache
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


def _to_wire(x: jax.Array, arithmetic: bool) -> jax.Array:
    wire = wire_dtype(x.dtype, arithmetic)
    if wire == x.dtype:
        return x
    return x.astype(wire) if arithmetic else jax.lax.bitcast_convert_type(x, wire)


def _from_wire(x: jax.Array, like: jax.Array, arithmetic: bool) -> jax.Array:
    if x.dtype == like.dtype:
        return x
    return x.astype(like.dtype) if arithmetic else jax.lax.bitcast_convert_type(x, like.dtype)


def _fused(leaves: list[jax.Array], collective: Any, *, arithmetic: bool) -> list[jax.Array]:
    """Applies an elementwise collective to every leaf, in as few calls as ``plan`` says.

    ``collective`` takes the list of flat buffers and returns them reduced (or moved);
    ``arithmetic`` says whether it computes on the values (a reduction) or only moves them
    (a broadcast), which decides how dtypes unknown to MPI travel.
    """
    wire = [_to_wire(x, arithmetic) for x in leaves]
    groups = plan(wire)
    buffers = [
        wire[g[0]] if len(g) == 1 else jnp.concatenate([wire[i].ravel() for i in g]) for g in groups
    ]
    out: list[Any] = list(wire)  # empty leaves stay as they are
    for group, flat in zip(groups, collective(buffers), strict=True):
        pieces = [flat] if len(group) == 1 else split(flat, [wire[i] for i in group])
        for i, piece in zip(group, pieces, strict=True):
            out[i] = piece
    return [_from_wire(x, like, arithmetic) for x, like in zip(out, leaves, strict=True)]


def _channels(comm: Any) -> tuple[int, int, Any, Any]:
    """(rank, size, communicator for compiled code, communicator for host calls).

    jaxddp never communicates on a user's communicator itself, only on private duplicates
    of it: a collective of a step still running on the runtime's thread and one made from
    Python must never share a communicator, nor with the user's own calls.
    """
    world = init()
    _progress.note("a jaxddp collective")
    if comm is None:
        return world.rank, world.size, world.jax_comm, world.py_comm
    host, compiled = private_comms(comm)
    return comm.Get_rank(), comm.Get_size(), compiled, host


_LOW_FLOATS = frozenset(
    np.dtype(t) for t in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)
)


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)  # pyright: ignore[reportAttributeAccessIssue]


def _mean(x: Any, size: int) -> Any:
    """The sum ``x`` divided by the world size: float32 for integer and boolean leaves."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "fc" or x.dtype in _LOW_FLOATS:
            return x / size
        return np.asarray(x / size, dtype=np.float32)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x / size
    return x / np.float32(size)


def allreduce(tree: Any, op: str = "mean", *, comm: Any = None) -> Any:
    """Reduces every leaf of a pytree across all ranks; usable inside and outside ``jax.jit``.

    Small leaves of one dtype travel together in a few flat buffers; large leaves travel
    alone. Every rank must call it with a tree of the same structure, shapes and dtypes.
    Inside ``jax.jit`` it adds no JAX effect, so the step keeps JAX's fast dispatch path.
    Outside it (concrete values: metrics, evaluation) the values go through mpi4py
    directly and come back as NumPy arrays.

    Args:
      tree: a pytree of arrays or numbers. Shapes and dtypes are kept, except that
        ``"mean"`` of an integer leaf is a float32 leaf, as with ``jnp.mean``.
      op: ``"sum"``, ``"mean"`` (sum divided by the world size), ``"max"`` or ``"min"``.
      comm: an mpi4py communicator to reduce over; by default ``COMM_WORLD``. jaxddp
        communicates on private duplicates of it, so it stays free for the caller's own
        mpi4py calls.

    Returns:
      A pytree of the same structure holding the reduced values, identical on every rank:
      jax arrays inside ``jax.jit``, NumPy arrays outside.

    Example:
      >>> import jax, jax.numpy as jnp, jaxddp
      >>> tree = {"w": jnp.ones(3), "step": jnp.int32(2)}
      >>> out = jax.jit(lambda t: jaxddp.allreduce(t, op="sum"))(tree)
      >>> out["w"].tolist() == [float(jaxddp.world_size())] * 3
      True
      >>> float(jaxddp.allreduce({"loss": 0.5})["loss"])  # outside jit: NumPy, no dispatch
      0.5
    """
    check_op(op)
    _, size, jax_comm, host_comm = _channels(comm)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mpi_op = _mpi_op(op)
    if all(_is_concrete(x) for x in leaves):
        leaves = [np.asarray(x) for x in leaves]
        if size > 1:
            leaves = _host.allreduce(leaves, mpi_op, host_comm)
    elif size > 1:

        def reduce(buffers: list[jax.Array]) -> list[jax.Array]:
            out = _primitive.allreduce_many(buffers, mpi_op, jax_comm)
            if op != "mean":
                return out
            # one division per buffer, before it is cut back into leaves
            return [b / size if jnp.issubdtype(b.dtype, jnp.inexact) else b for b in out]

        leaves = _fused([jnp.asarray(x) for x in leaves], reduce, arithmetic=True)
        if op == "mean":  # integer and boolean leaves: their float32 mean
            leaves = [x if jnp.issubdtype(x.dtype, jnp.inexact) else _mean(x, size) for x in leaves]
        return jax.tree_util.tree_unflatten(treedef, leaves)
    else:
        leaves = [jnp.asarray(x) for x in leaves]
    if op == "mean":
        leaves = [_mean(x, size) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def host_allreduce(buffers: list[np.ndarray], comm: Any = None) -> list[np.ndarray]:
    """Sums NumPy buffers across ranks through mpi4py (no JAX dispatch); a world of one
    gets them back as they are."""
    _, size, _, host_comm = _channels(comm)
    return _host.allreduce(buffers, _mpi_op("sum"), host_comm) if size > 1 else buffers


def _is_number_or_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | complex)


def _restore(old: Any, new: Any) -> Any:
    """A received value in the kind of its leaf: a number stays a number, a jax array a
    jax array, a NumPy array a NumPy array."""
    if not _is_concrete(new):
        return new
    if isinstance(old, int | float | complex):
        return type(old)(np.asarray(new).item())
    if isinstance(old, jax.Array):
        return jnp.asarray(new)
    return new


def _rooted(tree: Any, root: int, comm: Any, traced: Any, host: Any, *, arithmetic: bool) -> Any:
    """Applies a rooted collective to the array and number leaves; others pass unchanged.

    ``traced(buffers, jax_comm)`` runs it in compiled code, ``host(leaves, host_comm)`` on
    concrete values.
    """
    _, size, jax_comm, host_comm = _channels(comm)
    check_root(root, size)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    picked = [i for i, leaf in enumerate(leaves) if _is_number_or_array(leaf)]
    if size > 1 and picked:
        values = [leaves[i] for i in picked]
        if all(_is_concrete(x) for x in values):
            done = host([np.asarray(x) for x in values], host_comm)
        else:
            done = _fused(
                [jnp.asarray(x) for x in values],
                lambda bs: traced(bs, jax_comm),
                arithmetic=arithmetic,
            )
        for i, new in zip(picked, done, strict=True):
            leaves[i] = _restore(leaves[i], new)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def broadcast(tree: Any, root: int = 0, *, comm: Any = None) -> Any:
    """Gives every rank ``root``'s values of every array and number leaf.

    Leaves that are neither arrays nor numbers (strings, callables, ...) are returned
    unchanged; the others keep their kind (a jax array stays a jax array, a number a
    number). Every rank must pass a tree of the same structure, shapes and dtypes; use
    :func:`jaxddp.synchronize` to have that checked first. Works inside ``jax.jit``.

    Example:
      >>> import jax.numpy as jnp, jaxddp
      >>> state = {"params": jnp.arange(3.0), "name": "mlp", "step": 5}
      >>> jaxddp.broadcast(state, root=0)["name"]
      'mlp'
    """
    return _rooted(
        tree,
        root,
        comm,
        lambda bs, c: _primitive.bcast_many(bs, root, c),
        lambda xs, c: _host.broadcast(xs, root, c),
        arithmetic=False,
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
        lambda bs, c: _primitive.reduce_many(bs, mpi_op, root, c),
        lambda xs, c: _host.reduce(xs, mpi_op, root, c),
        arithmetic=True,
    )
    rank, size, _, _ = _channels(comm)
    if op != "mean" or rank != root:
        return out

    def mean(x: Any) -> Any:
        if isinstance(x, int | float | complex):
            return x / size
        return _mean(x, size) if _is_number_or_array(x) else x

    return jax.tree_util.tree_map(mean, out)
