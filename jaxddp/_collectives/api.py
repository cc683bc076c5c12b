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
from . import host as _host
from . import signature as _signature
from ._jax import primitives as _primitive
from .buckets import chunks, plan, split, wire_dtype

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
    "reduce_all",
    "world_size",
]

_OPS = ("sum", "mean", "max", "min")
_UFUNCS = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}


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
    for group, flat in zip(groups, _chunked(collective, buffers), strict=True):
        pieces = [flat] if len(group) == 1 else split(flat, [wire[i] for i in group])
        for i, piece in zip(group, pieces, strict=True):
            out[i] = piece
    return [_from_wire(x, like, arithmetic) for x, like in zip(out, leaves, strict=True)]


def _chunked(collective: Any, buffers: list[jax.Array]) -> list[jax.Array]:
    """``collective(buffers)``, with each buffer of more than :data:`MAX_COUNT` elements
    cut into chunks that an MPI call can count, and put back together after."""
    bounds = [chunks(b.size) for b in buffers]
    if all(len(b) == 1 for b in bounds):
        return collective(buffers)
    pieces = []
    for b, spans in zip(buffers, bounds, strict=True):
        flat = b if len(spans) == 1 else b.ravel()
        pieces.extend([b] if len(spans) == 1 else [flat[i:j] for i, j in spans])
    done = iter(collective(pieces))
    out = []
    for b, spans in zip(buffers, bounds, strict=True):
        parts = [next(done) for _ in spans]
        out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts).reshape(b.shape))
    return out


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


def is_key_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (NumPy dtypes and None never are)."""
    return not isinstance(dtype, np.dtype | None) and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _leaf_dtype(x: Any) -> Any:
    """A leaf's dtype without converting it; Python numbers by their kind."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None or not isinstance(x, bool | int | float | complex):
        return dtype
    return np.dtype(type(x))


def leaf_path(tree: Any, index: int) -> str:
    """The path (``jax.tree_util.keystr``) of the ``index``-th leaf of ``tree``, for errors."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.keystr(flat[index][0])


def check_reducible(
    tree: Any, leaves: list[Any], op: str, what: str, *, others_pass: bool = False
) -> None:
    """Raises, naming the leaf, for a leaf that ``op`` cannot reduce: anything but an array
    or a number (a string, a function: TypeError), a typed PRNG key (TypeError), or a
    complex number with ``max``/``min`` (ValueError). With ``others_pass``, leaves that are
    neither arrays nor numbers are left to pass unchanged.

    Decided from dtypes alone, before anything is sent, so every rank (whose trees match)
    raises the same error and no rank is left waiting in a collective.
    """
    for i, leaf in enumerate(leaves):
        dtype = _leaf_dtype(leaf)
        if others_pass and not _is_number_or_array(leaf):
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


def _widen(x: Any, op: str) -> Any:
    """A leaf in the dtype it is reduced in: booleans as uint8 for max and min (or and and)
    and as int32 for sum and mean (a count), integers for a mean as :func:`_sum_carrier`
    says, bfloat16 and float16 as float32 (so a mean divides before it is rounded back),
    other dtypes MPI lacks as :func:`wire_dtype` says."""
    if x.dtype == np.bool_:
        return x.astype(np.uint8 if op in ("max", "min") else np.int32)
    if op == "mean" and x.dtype.kind in "iu":
        return _sum_carrier(x)
    wide = wire_dtype(x.dtype, arithmetic=True)
    return x if wide == x.dtype else x.astype(wide)


def _x64() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def _halves(dtype: Any, traced: bool) -> bool:
    """Whether a mean of this integer dtype travels as 16-bit halves: 32-bit integers inside
    ``jax.jit`` without ``jax_enable_x64``, where no 64-bit type holds their sum."""
    dtype = np.dtype(dtype)
    return traced and dtype.kind in "iu" and dtype.itemsize == 4 and not _x64()


def _sum_carrier(x: Any) -> Any:
    """An integer leaf in a form whose sum over the ranks cannot overflow, for a mean.

    8- and 16-bit integers as int32 (exact for fewer than 2**15 ranks), 32-bit ones as
    int64 or uint64, or inside ``jax.jit`` without x64 as their high and low 16 bits, two
    int32 arrays stacked on a new first axis (exact, like int32 counts); 64-bit ones as
    float64 (exact to far below the float32 the mean is rounded to). ``int8`` ``[100, 100]``
    used to wrap to -28 before the division.
    """
    dtype = np.dtype(x.dtype)
    if _halves(dtype, traced=not isinstance(x, np.ndarray)):
        return jnp.stack([x >> 16, x & 0xFFFF]).astype(jnp.int32)
    if dtype.itemsize <= 2:
        wide = np.int32
    elif dtype.itemsize == 4:
        wide = np.int64 if dtype.kind == "i" else np.uint64
    else:
        wide = np.float64
    return x.astype(wide)


def _from_halves(x: Any, dtype: Any) -> Any:
    """A leaf that travelled as halves (not reduced: a non-root rank's own), put back."""
    high, low = x[0].astype(dtype), x[1].astype(dtype)
    return high * dtype.type(1 << 16) + low


def _narrow(x: Any, dtype: Any, op: str) -> Any:
    """A reduced leaf back in the dtype a user gets: that of the leaf, except that a sum of
    booleans is an int32 count and a mean of integers or booleans is float32."""
    if dtype == np.bool_ and op in ("sum", "mean"):
        return x
    if op == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
        return x
    return x if x.dtype == dtype else x.astype(dtype)


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, Tracer)


def _mean(x: Any, size: int, dtype: Any) -> Any:
    """The sum ``x`` of leaves of ``dtype`` divided by the world size: float32 for integer
    and boolean leaves, divided in the widest float there is, then rounded once."""
    inexact = jnp.issubdtype(dtype, jnp.inexact)
    if isinstance(x, np.ndarray):
        if inexact:  # bfloat16 and float16 arrive widened to float32
            return x / size
        return np.asarray(x / size, dtype=np.float32)
    if inexact:
        return x / size
    if _halves(dtype, traced=True):  # the exact sum, rounded once to float32, then divided
        total = x[0].astype(jnp.float32) * np.float32(1 << 16) + x[1].astype(jnp.float32)
        return total / np.float32(size)
    wide = jnp.float64 if _x64() else jnp.float32
    return (x.astype(wide) / size).astype(jnp.float32)


def allreduce(tree: Any, op: str = "mean", *, comm: Any = None) -> Any:
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
    tree: Any,
    op: str,
    *,
    comm: Any = None,
    check: bool | None = None,
    what: str = "tree passed to `allreduce`",
    call: str = "allreduce",
) -> Any:
    """:func:`allreduce`, with its signature check chosen (``check``; None: ``JAXDDP_CHECK``)
    and described (``what``, ``call``) by the caller."""
    check_op(op)
    _, size, jax_comm, host_comm = _channels(comm)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mpi_op = _mpi_op(op)
    concrete = not any(isinstance(x, Tracer) for x in leaves)

    def agree(payload: Any = None) -> Any:  # the signature check, once per call
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
            leaves, mpi_op, host_comm, size, mean=op == "mean", ufunc=_UFUNCS[op], agree=agree
        )
        if metrics is not None:
            return jax.tree_util.tree_unflatten(treedef, metrics)
    if size > 1:
        agree()
    check_reducible(tree, leaves, op, "allreduce")
    if concrete:
        leaves = [np.asarray(x) for x in leaves]
        dtypes = [x.dtype for x in leaves]
        leaves = [_widen(x, op) for x in leaves]
        if size > 1:
            leaves = _host.allreduce(leaves, mpi_op, host_comm)
    elif size > 1:

        def reduce(buffers: list[jax.Array]) -> list[jax.Array]:
            out = _primitive.allreduce_many(buffers, mpi_op, jax_comm)
            if op != "mean":
                return out
            # one division per buffer, before it is cut back into leaves
            return [b / size if jnp.issubdtype(b.dtype, jnp.inexact) else b for b in out]

        leaves = [jnp.asarray(x) for x in leaves]
        dtypes = [x.dtype for x in leaves]
        leaves = _fused([_widen(x, op) for x in leaves], reduce, arithmetic=True)
        if op == "mean":  # integer and boolean leaves: their float32 mean
            leaves = [
                x if jnp.issubdtype(x.dtype, jnp.inexact) else _mean(x, size, d)
                for x, d in zip(leaves, dtypes, strict=True)
            ]
        leaves = [_narrow(x, d, op) for x, d in zip(leaves, dtypes, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, leaves)
    else:
        leaves = [jnp.asarray(x) for x in leaves]
        dtypes = [x.dtype for x in leaves]
        leaves = [_widen(x, op) for x in leaves]
    if op == "mean":
        leaves = [_mean(x, size, d) for x, d in zip(leaves, dtypes, strict=True)]
    leaves = [_narrow(x, d, op) for x, d in zip(leaves, dtypes, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _is_number_or_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | complex)


def restore_kind(old: Any, new: Any) -> Any:
    """A received value in the kind of its leaf: a number stays a number (of the result's
    kind: a mean of ints is a float, a count of bools an int), a jax array a jax array, a
    NumPy array a NumPy array."""
    if not _is_concrete(new):
        return new
    if isinstance(old, int | float | complex):
        value = np.asarray(new).item()
        return type(old)(value) if type(value) is type(np.asarray(old).item()) else value
    if isinstance(old, jax.Array):
        return jnp.asarray(new)
    return new


def _rooted(
    tree: Any,
    root: int,
    comm: Any,
    traced: Any,
    host: Any,
    *,
    arithmetic: bool,
    op: str | None = None,
) -> Any:
    """Applies a rooted collective to the array and number leaves; others pass unchanged.

    ``traced(buffers, jax_comm)`` runs it in compiled code, ``host(leaves, host_comm)`` on
    concrete values. A reduction (``op`` given) refuses the leaves it cannot reduce before
    anything is sent, reduces each leaf in the dtype :func:`_widen` gives it and, on
    ``root``, divides a ``"mean"``; the other ranks get their leaves back. A broadcast
    (``op=None``) moves a typed PRNG key as its key data and gives back a key.
    """
    rank, size, jax_comm, host_comm = _channels(comm)
    check_root(root, size)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if size > 1:
        concrete = all(_is_concrete(x) for x in leaves)
        call = "broadcast" if op is None else "reduce"
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
    if op is not None:
        check_reducible(tree, leaves, op, "reduce", others_pass=True)
    picked = [i for i, leaf in enumerate(leaves) if _is_number_or_array(leaf)]
    if not picked or (size == 1 and op is None):
        return tree
    values = [leaves[i] for i in picked]
    concrete = all(_is_concrete(x) for x in values)
    keys = [is_key_dtype(_leaf_dtype(x)) for x in values]
    values = [jax.random.key_data(x) if key else x for x, key in zip(values, keys, strict=True)]
    values = [np.asarray(x) if concrete else jnp.asarray(x) for x in values]
    dtypes = [x.dtype for x in values]
    if op is not None:
        values = [_widen(x, op) for x in values]
    if size > 1 and concrete:
        values = host(values, host_comm)
    elif size > 1:
        values = _fused(
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
    x: Any, dtype: Any, *, key: bool, leaf: Any, op: str | None, is_root: bool, size: int
) -> Any:
    """A leaf after a rooted collective, in the dtype it is given back in."""
    if op is not None and is_root:
        return _narrow(_mean(x, size, dtype) if op == "mean" else x, dtype, op)
    if op == "mean" and _halves(dtype, traced=not isinstance(x, np.ndarray)):
        return _from_halves(x, np.dtype(dtype))  # not root: its own values, put back
    if op is not None:  # not root: its own values, back in their own dtype (exactly)
        return x if x.dtype == dtype else x.astype(dtype)
    if key:  # a broadcast key: its key data, made a key again
        return jax.random.wrap_key_data(jnp.asarray(x), impl=jax.random.key_impl(leaf))
    return x


def broadcast(tree: Any, root: int = 0, *, comm: Any = None) -> Any:
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
        lambda bs, c: _primitive.bcast_many(bs, root, c),
        lambda xs, c: _host.broadcast(xs, root, c),
        arithmetic=False,
    )


def reduce(tree: Any, op: str, root: int = 0, *, comm: Any = None) -> Any:
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
    mpi_op = _mpi_op(op)
    return _rooted(
        tree,
        root,
        comm,
        lambda bs, c: _primitive.reduce_many(bs, mpi_op, root, c),
        lambda xs, c: _host.reduce(xs, mpi_op, root, c),
        arithmetic=True,
        op=op,
    )
