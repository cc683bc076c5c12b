"""The pytree collectives: allreduce, broadcast and reduce, inside and outside ``jax.jit``.

The world itself (start-up, rank and size, the private communicators) lives in
:mod:`jaxddp._runtime.world`; its functions are re-exported here so that call sites keep working.
mpi4jax is imported only through :func:`mpi4jax`, after MPI has been initialized.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from .._base import progress as _progress
from .._runtime.world import (
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
from .._types import Communicator, PyTree, ReduceOp
from . import dtypes as _dtypes
from . import host as _host
from . import signature as _signature
from ._jax import ops
from .checks import check_op, check_reducible, check_root, is_number_or_array
from .dtypes import is_key_dtype
from .wire import fused

__all__ = [
    "allreduce",
    "broadcast",
    "channels",
    "init",
    "is_concrete",
    "jax_comm",
    "local_rank",
    "mpi",
    "mpi4jax",
    "mpi_op_of",
    "py_comm",
    "rank",
    "reduce",
    "reduce_all",
    "restore_kind",
    "world_size",
]

_UFUNCS = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}


@functools.cache
def mpi_op_of(op: str) -> Any:
    MPI = mpi()
    return {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]


def channels(comm: Communicator | None) -> tuple[int, int, Any, Any]:
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
    # inside a step that jaxddp.spmd traces, refused before anything else, on every rank
    # (a rank alone in its communicator would otherwise skip the collective and wait)
    ops.implementation(compiled)
    return comm.Get_rank(), comm.Get_size(), compiled, host


def is_concrete(x: Any) -> bool:
    return not isinstance(x, Tracer)


def agreed(
    tree: PyTree, comm: Communicator | None, call: str, *, op: Any = None, root: Any = None
) -> tuple[int, int, tuple[Any, Any], tuple[list[Any], Any], bool]:
    """A collective's start: ``(rank, size, (compiled comm, host comm), (leaves, treedef),
    concrete)`` once every rank of ``comm`` agreed on the signature of ``call`` of ``tree``
    (``JAXDDP_CHECK``; a ``root`` is checked against the size first)."""
    rank, size, jax_comm, host_comm = channels(comm)
    if root is not None:
        check_root(root, size)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    concrete = all(is_concrete(x) for x in leaves)
    if size > 1:
        _signature.check_call(
            host_comm,
            call,
            what=f"tree passed to `{call}`",
            traced=not concrete,
            op=op,
            root=root,
            tree=tree,
            flat=(leaves, treedef),
        )
    return rank, size, (jax_comm, host_comm), (leaves, treedef), concrete


def allreduce(tree: PyTree, op: ReduceOp = "mean", *, comm: Communicator | None = None) -> Any:
    """Reduces every leaf of a pytree across all ranks; usable inside and outside ``jax.jit``.

    Small leaves of one dtype travel together in a few flat buffers; large leaves travel
    alone. Every rank must call it with a tree of the same structure, shapes and dtypes
    and the same ``op``; before anything is sent the ranks check that they do, and raise
    :class:`jaxddp.TreeMismatchError` on every rank naming the first difference (inside
    ``jax.jit`` once per compilation; outside it a few metrics travel with the check in
    one message, larger trees after it; ``JAXDDP_CHECK=0`` turns the check off). Inside
    ``jax.jit`` it adds no JAX effect, so the step keeps JAX's fast dispatch path. Outside
    it (concrete values: metrics, evaluation) the values go through mpi4py directly and
    come back as NumPy arrays. It differentiates like ``jax.lax.psum``: the
    cotangents are summed over the ranks (every rank computes the same result from every
    rank's values); ``"max"`` and ``"min"`` pass the gradient to the rank holding the
    extreme, shared equally among ranks that tie.

    Args:
      tree: a pytree of arrays or numbers. Shapes and dtypes are kept, except that
        ``"mean"`` of an integer leaf is a float32 leaf, as with ``jnp.mean``, summed
        without overflow (wide, or as 16-bit halves) before it is divided. Boolean
        leaves: ``"max"`` is a logical or, ``"min"`` a logical and (both stay boolean),
        ``"sum"`` the int32 count of True and ``"mean"`` its float32 fraction. bfloat16
        and float16 leaves are reduced (and a mean divided) in float32, then rounded once.
        Typed PRNG keys are refused (TypeError), and so are complex leaves with ``"max"``
        or ``"min"`` (ValueError), before anything is sent; the error names the leaf.
        Leaves of 2**31 elements or more travel in chunks an MPI call can count.
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
    return reduce_all(tree, op, comm=comm)


def reduce_all(
    tree: PyTree,
    op: ReduceOp,
    *,
    comm: Communicator | None = None,
    check: bool | None = None,
    what: str = "tree passed to `allreduce`",
    call: str = "allreduce",
) -> Any:
    """:func:`allreduce`, with its signature check chosen (``check``; None: ``JAXDDP_CHECK``)
    and described (``what``, ``call``) by the caller."""
    check_op(op)
    _, size, jax_comm, host_comm = channels(comm)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mpi_op = mpi_op_of(op)
    concrete = not any(isinstance(x, Tracer) for x in leaves)

    def check_signature(payload: Any = None) -> Any:  # once per call
        return _signature.check_call(
            host_comm,
            call,
            what=what,
            check=check,
            traced=not concrete,
            op=op,
            tree=tree,
            flat=(leaves, treedef),
            payload=payload,
        )

    if concrete:  # the common case first, kept short: a few float metrics
        metrics = _host.metrics(
            leaves,
            mpi_op,
            host_comm,
            size,
            mean=op == "mean",
            ufunc=_UFUNCS[op],
            check_signature=check_signature,
        )
        if metrics is not None:
            return jax.tree_util.tree_unflatten(treedef, metrics)
    if size > 1:
        check_signature()
    check_reducible(tree, leaves, op, "allreduce")
    if concrete:
        leaves = [np.asarray(x) for x in leaves]
        dtypes = [x.dtype for x in leaves]
        leaves = [_dtypes.widen(x, op) for x in leaves]
        if size > 1:
            leaves = _host.allreduce(leaves, mpi_op, host_comm)
    elif size > 1:

        def reduce(buffers: list[jax.Array], calls: list[str]) -> list[jax.Array]:
            out = ops.allreduce_many(buffers, mpi_op, jax_comm, [f"{op} of {c}" for c in calls])
            if op != "mean":
                return out
            # one division per buffer, before it is cut back into leaves
            return [b / size if jnp.issubdtype(b.dtype, jnp.inexact) else b for b in out]

        leaves = [jnp.asarray(x) for x in leaves]
        dtypes = [x.dtype for x in leaves]
        labels = [_signature.leaf_kind(x) for x in leaves]  # the dtypes asked for
        leaves = [_dtypes.widen(x, op) for x in leaves]
        leaves = fused(leaves, reduce, arithmetic=True, labels=labels)
        if op == "mean":  # integer and boolean leaves: their float32 mean
            leaves = [
                x if jnp.issubdtype(x.dtype, jnp.inexact) else _dtypes.mean(x, size, d)
                for x, d in zip(leaves, dtypes, strict=True)
            ]
        leaves = [_dtypes.narrow(x, d, op) for x, d in zip(leaves, dtypes, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, leaves)
    else:
        leaves = [jnp.asarray(x) for x in leaves]
        dtypes = [x.dtype for x in leaves]
        leaves = [_dtypes.widen(x, op) for x in leaves]
    if op == "mean":
        leaves = [_dtypes.mean(x, size, d) for x, d in zip(leaves, dtypes, strict=True)]
    leaves = [_dtypes.narrow(x, d, op) for x, d in zip(leaves, dtypes, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def restore_kind(old: Any, new: Any) -> Any:
    """A received value in the kind of its leaf: a number stays a number (of the result's
    kind: a mean of ints is a float, a count of bools an int), a jax array a jax array, a
    NumPy array a NumPy array."""
    if not is_concrete(new):
        return new
    if isinstance(old, int | float | complex):
        value = np.asarray(new).item()
        return type(old)(value) if type(value) is type(np.asarray(old).item()) else value
    if isinstance(old, jax.Array):
        return jnp.asarray(new)
    return new


def _rooted(
    tree: PyTree,
    root: int,
    comm: Communicator | None,
    traced: Any,
    host: Any,
    *,
    arithmetic: bool,
    op: ReduceOp | None = None,
) -> Any:
    """Applies a rooted collective to the array and number leaves; others pass unchanged.

    ``traced(buffers, jax_comm)`` runs it in compiled code, ``host(leaves, host_comm)`` on
    concrete values. A reduction (``op`` given) refuses the leaves it cannot reduce before
    anything is sent, reduces each leaf in the dtype :func:`_dtypes.widen` gives it and, on
    ``root``, divides a ``"mean"``; the other ranks get their leaves back. A broadcast
    (``op=None``) moves a typed PRNG key as its key data and gives back a key.
    """
    call = "broadcast" if op is None else "reduce"
    rank, size, (jax_comm, host_comm), (leaves, treedef), _ = agreed(
        tree, comm, call, op=op, root=root
    )
    if op is not None:
        check_reducible(tree, leaves, op, "reduce", others_pass=True)
    picked = [i for i, leaf in enumerate(leaves) if is_number_or_array(leaf)]
    if not picked or (size == 1 and op is None):
        return tree
    values = [leaves[i] for i in picked]
    concrete = all(is_concrete(x) for x in values)
    keys = [is_key_dtype(_dtypes.leaf_dtype(x)) for x in values]
    values = [jax.random.key_data(x) if key else x for x, key in zip(values, keys, strict=True)]
    values = [np.asarray(x) if concrete else jnp.asarray(x) for x in values]
    dtypes = [x.dtype for x in values]
    if op is not None:
        values = [_dtypes.widen(x, op) for x in values]
    if size > 1 and concrete:
        values = host(values, host_comm)
    elif size > 1:
        values = fused(
            [jnp.asarray(x) for x in values],
            lambda bs: traced(bs, jax_comm),
            arithmetic=arithmetic,
        )
    for i, got, dtype, key in zip(picked, values, dtypes, keys, strict=True):
        leaves[i] = restore_kind(
            leaves[i],
            _finish(got, dtype, key=key, leaf=leaves[i], op=op, is_root=rank == root, size=size),
        )
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _finish(
    x: Any, dtype: Any, *, key: bool, leaf: Any, op: ReduceOp | None, is_root: bool, size: int
) -> Any:
    """A leaf after a rooted collective, in the dtype it is given back in."""
    if op is not None and is_root:
        return _dtypes.narrow(_dtypes.mean(x, size, dtype) if op == "mean" else x, dtype, op)
    if op == "mean" and _dtypes.halves(dtype, traced=not isinstance(x, np.ndarray)):
        return _dtypes.from_halves(x, np.dtype(dtype))  # not root: its own values, put back
    if op is not None:  # not root: its own values, back in their own dtype (exactly)
        return x if x.dtype == dtype else x.astype(dtype)
    if key:  # a broadcast key: its key data, made a key again
        return jax.random.wrap_key_data(jnp.asarray(x), impl=jax.random.key_impl(leaf))
    return x


def broadcast(tree: PyTree, root: int = 0, *, comm: Communicator | None = None) -> Any:
    """Gives every rank ``root``'s values of every array and number leaf.

    Leaves that are neither arrays nor numbers (strings, callables, ...) are returned
    unchanged; the others keep their kind (a jax array stays a jax array, a number a
    number). Typed PRNG keys (``jax.random.key``, the keys of ``flax.nnx.Rngs``) travel as
    their key data and come back as keys of the same implementation. Every rank must pass
    a tree of the same structure, shapes and dtypes and the same ``root``; the ranks check
    that first, as :func:`allreduce` does. Works inside ``jax.jit``.

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
        lambda bs, c: ops.bcast_many(bs, root, c),
        lambda xs, c: _host.broadcast(xs, root, c),
        arithmetic=False,
    )


def reduce(tree: PyTree, op: ReduceOp, root: int = 0, *, comm: Communicator | None = None) -> Any:
    """Reduces every array and number leaf onto ``root``.

    On ``root`` the leaves hold the reduction (``"mean"`` divides the sum by the world
    size), with the dtypes and refusals of :func:`allreduce`; on the other ranks they are
    returned as they were passed. Other leaves are returned unchanged.

    Example:
      >>> import jax.numpy as jnp, jaxddp
      >>> total = jaxddp.reduce({"loss": jnp.float32(2.0)}, "sum", root=0)
      >>> float(total["loss"]) == 2.0 * jaxddp.world_size()
      True
    """
    check_op(op)
    mpi_op = mpi_op_of(op)
    return _rooted(
        tree,
        root,
        comm,
        lambda bs, c: ops.reduce_many(bs, mpi_op, root, c),
        lambda xs, c: _host.reduce(xs, mpi_op, root, c),
        arithmetic=True,
        op=op,
    )
