"""How jaxddp's collectives become XLA custom calls: the FFI targets mpi4jax registers (and
jaxddp's own allreduce, :mod:`jaxddp._native`), their attributes, and the token that chains
one call to the next."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.core import ShapedArray

from ... import _native
from ..._base import mpi as _mpi
from . import compat

__all__ = ["Handle", "emit", "out_avals"]


class Handle:
    """An MPI object as a primitive parameter: hashable by its C handle, as jit requires."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.handle = _mpi.c_handle(obj)

    def __hash__(self) -> int:
        return hash(self.handle)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.handle == self.handle

    def __repr__(self) -> str:
        return f"Handle({self.handle})"


# The predefined MPI datatype of each dtype that travels as it is (mpi4jax's choice too).
_MPI_TYPES = {
    "float32": "FLOAT", "float64": "DOUBLE", "complex64": "COMPLEX",
    "complex128": "DOUBLE_COMPLEX", "bool": "BOOL",
    "int8": "INT8_T", "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
    "uint8": "UINT8_T", "uint16": "UINT16_T", "uint32": "UINT32_T", "uint64": "UINT64_T",
}  # fmt: skip


def _dtype_handle(dtype: Any) -> np.int64:
    from mpi4py import MPI

    return np.int64(Handle(getattr(MPI, _MPI_TYPES[np.dtype(dtype).name])).handle)


# What each collective's FFI target takes besides the buffer, from the primitive's params
# and the buffer's abstract value.
def _attrs(kind: str, params: dict[str, Any], aval: Any) -> dict[str, Any]:
    attrs = {"comm": np.int64(params["comm"].handle)}
    dtype = _dtype_handle(aval.dtype)
    nitems = np.int64(np.prod(aval.shape, dtype=np.int64))
    if kind in _MOVES:  # the count each rank sends to (allgather: and gets from) each rank
        count = nitems if kind == "allgather" else np.int64(nitems // params["size"])
        return dict(attrs, sendcount=count, sendtype=dtype, recvcount=count, recvtype=dtype)
    attrs.update(nitems=nitems, dtype=dtype)
    if kind in ("allreduce", "reduce"):
        attrs["op"] = np.int64(params["op"].handle)
    if kind in ("bcast", "reduce"):
        attrs["root"] = np.int64(params["root"])
    return attrs


_TARGETS = {
    "allreduce": "mpi_allreduce_ffi",
    "bcast": "mpi_bcast_ffi",
    "reduce": "mpi_reduce_ffi",
    "allgather": "mpi_allgather_ffi",
    "alltoall": "mpi_alltoall_ffi",
}
# The collectives that only move data, with a `size` parameter (the communicator's size):
# an allgather returns (size, *shape), an alltoall sends row j of its (size, ...) input to
# rank j and returns row i from rank i.
_MOVES = ("allgather", "alltoall")


def emit(
    ctx: Any, token: Any, xs: Sequence[Any], avals: tuple[Any, Any], *, kind: str, params: Any
) -> tuple[Any, list[Any]]:
    """One side-effecting custom call per buffer, each taking the previous call's token."""

    target = _TARGETS[kind]
    if kind == "allreduce" and tuple(ctx.module_context.platforms) == ("cpu",):
        target = _native.allreduce_target() or target  # what every rank agreed on
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True)
    outs = []
    for x, aval_in, aval_out in zip(xs, *avals, strict=True):
        token_aval = compat.abstract_token()
        sub = ctx.replace(avals_in=(aval_in, token_aval), avals_out=(aval_out, token_aval))
        out, token = rule(sub, x, token, **_attrs(kind, params, aval_in))
        outs.append(out)
    return token, outs


def out_avals(kind: str, avals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """A broadcast's root and a reduce's non-roots get nothing back (their input stands);
    an allgather gets every rank's buffer, stacked on a new first axis."""
    if kind == "allgather":
        return [ShapedArray((params["size"], *a.shape), a.dtype) for a in avals]
    empty = (kind == "bcast" and params["is_root"]) or (kind == "reduce" and not params["is_root"])
    return [ShapedArray((0,) if empty else a.shape, a.dtype) for a in avals]
