"""One record per collective kind: what its custom call is (the FFI target and its
attributes), what it returns, and whether it differentiates and batches.

:mod:`.lowering` emits the calls from these records and :mod:`.primitives` makes one
primitive per record and registers its rules from it: adding a collective is one record
here and one wrapper in :mod:`.ops`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.core import ShapedArray

from ..._base import mpi as _mpi

__all__ = ["RECORDS", "Handle", "Record"]


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


@dataclasses.dataclass(frozen=True)
class Record:
    """A collective kind. ``attrs(params, nitems, dtype)`` gives its FFI target's attributes
    besides ``comm``, from the primitive's params, the buffer's element count and the MPI
    handle of its dtype; ``out_aval(aval, params)`` what it returns for one buffer."""

    kind: str  # its primitives are jaxddp_<kind> (and jaxddp_<kind>_tangent)
    name: str  # as its errors call it
    target: str  # the FFI target mpi4jax registers
    attrs: Callable[[dict[str, Any], np.int64, np.int64], dict[str, Any]]
    out_aval: Callable[[Any, dict[str, Any]], ShapedArray] = lambda a, params: ShapedArray(
        a.shape, a.dtype
    )
    native: bool = False  # on CPU, jaxddp's own handler where every rank loaded it
    differentiable: bool = False  # jvp and transpose as `jax.lax.psum`'s (else: refused)
    batchable: bool = False  # elementwise: vmap passes through it

    def call_attrs(self, params: dict[str, Any], aval: Any) -> dict[str, Any]:
        """Every attribute of one custom call on a buffer of ``aval``."""
        nitems = np.int64(np.prod(aval.shape, dtype=np.int64))
        attrs = self.attrs(params, nitems, _dtype_handle(aval.dtype))
        return {"comm": np.int64(params["comm"].handle), **attrs}


def _empty_where(nothing_back: Callable[[dict[str, Any]], bool]) -> Any:
    """A broadcast's root and a reduce's non-roots get nothing back (their input stands)."""

    def out_aval(a: Any, params: dict[str, Any]) -> ShapedArray:
        return ShapedArray((0,) if nothing_back(params) else a.shape, a.dtype)

    return out_aval


def _counts(count: np.int64, dtype: np.int64) -> dict[str, Any]:
    """What a move (allgather, alltoall) sends to and gets from each rank."""
    return {"sendcount": count, "sendtype": dtype, "recvcount": count, "recvtype": dtype}


RECORDS = {
    record.kind: record
    for record in (
        Record(
            "allreduce",
            "allreduce",
            "mpi_allreduce_ffi",
            lambda p, n, d: {"nitems": n, "dtype": d, "op": np.int64(p["op"].handle)},
            native=True,
            differentiable=True,
            batchable=True,
        ),
        Record(
            "bcast",
            "broadcast",
            "mpi_bcast_ffi",
            lambda p, n, d: {"nitems": n, "dtype": d, "root": np.int64(p["root"])},
            out_aval=_empty_where(lambda p: p["is_root"]),
        ),
        Record(
            "reduce",
            "reduce",
            "mpi_reduce_ffi",
            lambda p, n, d: {
                "nitems": n,
                "dtype": d,
                "op": np.int64(p["op"].handle),
                "root": np.int64(p["root"]),
            },
            out_aval=_empty_where(lambda p: not p["is_root"]),
        ),
        # Moves only (for the sharded optimizer), with the communicator's `size` in their
        # params: an allgather stacks every rank's buffer on a new first axis...
        Record(
            "allgather",
            "allgather",
            "mpi_allgather_ffi",
            lambda p, n, d: _counts(n, d),
            out_aval=lambda a, p: ShapedArray((p["size"], *a.shape), a.dtype),
        ),
        # ...an alltoall sends row j of its (size, ...) input to rank j, gets row i from i.
        Record(
            "alltoall",
            "alltoall",
            "mpi_alltoall_ffi",
            lambda p, n, d: _counts(np.int64(n // p["size"]), d),
        ),
    )
}
