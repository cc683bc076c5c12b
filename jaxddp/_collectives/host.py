"""Collectives on concrete values: NumPy buffers through mpi4py, no JAX dispatch at all.

Outside ``jax.jit`` (metrics logged each step, an evaluation's ``masked_mean``), compiling
and dispatching a tiny executable costs far more than moving a few bytes. Here the leaves
are read into NumPy, packed as :func:`jaxddp._collectives.wire.plan` says (the same messages the
compiled path sends) and reduced in place with mpi4py. Results are NumPy arrays.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._types import Communicator
from .wire import ALONE_BYTES, chunks, from_wire, plan, split, to_wire

__all__ = ["allreduce", "broadcast", "reduce"]


def _apply(
    leaves: list[Any], call: Any, *, arithmetic: bool, receive: bool = True
) -> list[np.ndarray]:
    """Runs ``call(buffer)`` in place on each packed buffer (on each chunk of one of more
    than :data:`MAX_COUNT` elements); returns the unpacked leaves.

    ``receive=False`` (a rank whose buffers are only sent) skips the unpacking.
    """
    dtypes = [np.asarray(x).dtype for x in leaves]
    wire = [to_wire(np.asarray(x), arithmetic) for x in leaves]
    out: list[np.ndarray] = list(wire)  # empty leaves stay as they are
    for group in plan(wire):
        buffer = np.concatenate([wire[i].ravel() for i in group])  # a writable copy
        for start, stop in chunks(buffer.size):  # views: each call works in place
            call(buffer[start:stop])
        if receive:
            for i, piece in zip(group, split(buffer, [wire[i] for i in group]), strict=True):
                out[i] = piece
    return [from_wire(x, d, arithmetic) for x, d in zip(out, dtypes, strict=True)]


_METRIC_DTYPES = frozenset(np.dtype(t) for t in ("float32", "float64"))


def metrics(
    leaves: list[Any],
    op: Any,
    comm: Communicator,
    size: int,
    *,
    mean: bool,
    ufunc: Any,
    check_signature: Any,
) -> list[Any] | None:
    """``allreduce`` of a few concrete float32 or float64 arrays of one dtype (what a
    training loop logs every step), kept short: one buffer, one MPI call, the mean divided
    in place. None when the leaves are anything else (other dtypes, numbers, many bytes),
    for the general path to handle; decided from their dtypes alone, the same on every
    rank whose tree matches, before anything is sent.

    ``check_signature(buffer)`` is the signature check (:mod:`jaxddp._collectives.signature`):
    when it returns every rank's buffer as rows, the buffer travelled with it and ``ufunc``
    (the NumPy counterpart of the MPI ``op``) reduces them here; when it returns None, the
    buffer travels in an ``Allreduce``."""
    dtype = getattr(leaves[0], "dtype", None) if leaves else None
    if dtype is None or dtype not in _METRIC_DTYPES:
        return None
    arrays = []
    for x in leaves:
        if getattr(x, "dtype", None) != dtype:
            return None
        arrays.append(np.asarray(x))
    if all(a.ndim == 0 for a in arrays):  # scalars: the common case
        if len(arrays) * dtype.itemsize >= ALONE_BYTES:
            return None
        buffer = np.array(arrays, dtype)
        pieces = None
    else:
        if sum(a.size for a in arrays) * dtype.itemsize >= ALONE_BYTES:
            return None
        buffer = np.concatenate([a.ravel() for a in arrays])  # a copy, even of one
        pieces = arrays
    if size > 1:
        rows = check_signature(buffer)
        if rows is None:
            comm.Allreduce(in_place(), buffer, nan_aware(op, buffer.dtype))
        else:
            ufunc.reduce(rows, axis=0, out=buffer)
    if mean:
        np.divide(buffer, size, out=buffer)
    if pieces is None:
        return [buffer[i, ...] for i in range(len(arrays))]
    return split(buffer, pieces)


@functools.cache
def in_place() -> Any:
    """``MPI.IN_PLACE``, looked up once (a per-call import costs a microsecond)."""
    from mpi4py import MPI

    return MPI.IN_PLACE


@functools.cache
def _nan_ops() -> dict[str, Any]:
    """MPI ops for a maximum and a minimum of floats in which a NaN on any rank is the
    result, as in NumPy's ``maximum`` (MPI's own MAX and MIN keep it or drop it depending
    on the library and on which rank holds it). Measured at 2 ranks against MPI's MAX:
    as fast from 1 KB up (the ufunc runs where MPI's loop would), 3 us more for 8 bytes."""
    from mpi4py import MPI

    def user_op(ufunc: Any) -> Any:
        def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            dtype = np.float32 if datatype.Get_size() == 4 else np.float64
            out = np.frombuffer(inoutbuf, dtype)
            ufunc(np.frombuffer(inbuf, dtype), out, out=out)

        return MPI.Op.Create(combine, commute=True)

    return {"MAX": user_op(np.maximum), "MIN": user_op(np.minimum)}


def nan_aware(op: Any, dtype: Any) -> Any:
    """``op``, or for MPI's MAX or MIN of float32 or float64 its NaN-keeping counterpart."""
    from mpi4py import MPI

    if np.dtype(dtype) not in (np.float32, np.float64) or op not in (MPI.MAX, MPI.MIN):
        return op
    return _nan_ops()["MAX" if op == MPI.MAX else "MIN"]


def allreduce(leaves: list[np.ndarray], op: Any, comm: Communicator) -> list[np.ndarray]:
    """Each leaf reduced with the MPI op ``op`` over ``comm``, as NumPy arrays."""
    from mpi4py import MPI

    return _apply(
        leaves,
        lambda b: comm.Allreduce(MPI.IN_PLACE, b, nan_aware(op, b.dtype)),
        arithmetic=True,
    )


def broadcast(leaves: list[Any], root: int, comm: Communicator) -> list[np.ndarray]:
    """``root``'s leaves on every rank, as NumPy arrays."""
    return _apply(leaves, lambda b: comm.Bcast(b, root), arithmetic=False)


def reduce(leaves: list[Any], op: Any, root: int, comm: Communicator) -> list[np.ndarray]:
    """Each leaf reduced onto ``root``; the other ranks get their leaves back as NumPy."""
    from mpi4py import MPI

    if comm.Get_rank() == root:
        return _apply(
            leaves,
            lambda b: comm.Reduce(MPI.IN_PLACE, b, nan_aware(op, b.dtype), root),
            arithmetic=True,
        )
    _apply(
        leaves,
        lambda b: comm.Reduce(b, None, nan_aware(op, b.dtype), root),
        arithmetic=True,
        receive=False,
    )
    return [np.asarray(x) for x in leaves]
