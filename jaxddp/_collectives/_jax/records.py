"""One record per collective kind of the table (``jaxddp/_native/kinds.py``): its row (FFI
target, attribute names, whether it differentiates and batches) with what JAX needs of it,
its custom call's attribute values and its output shapes.

:mod:`.lowering` emits the calls from these records and :mod:`.primitives` makes one
primitive per record and registers its rules from it. A new kind whose attributes and output
are among those below needs nothing here (README.md of this folder: what adding one touches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.core import ShapedArray

from ..._base import mpi as _mpi
from ..._native.kinds import KINDS, Kind

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


# Each attribute a custom call takes, by its name in the table (jaxddp/_native/kinds.py),
# from the primitive's params, the buffer's element count and the MPI handle of its dtype.
_ATTRIBUTES: dict[str, Callable[[Kind, dict[str, Any], np.int64, np.int64], np.int64]] = {
    "comm": lambda k, p, n, d: np.int64(p["comm"].handle),
    "op": lambda k, p, n, d: np.int64(p["op"].handle),
    "root": lambda k, p, n, d: np.int64(p["root"]),
    "dtype": lambda k, p, n, d: d,
    "nitems": lambda k, p, n, d: n,
    # what a move (allgather, alltoall) sends to and gets from each rank
    "sendcount": lambda k, p, n, d: np.int64(n // p["size"]) if k.rows else n,
    "recvcount": lambda k, p, n, d: np.int64(n // p["size"]) if k.rows else n,
    "sendtype": lambda k, p, n, d: d,
    "recvtype": lambda k, p, n, d: d,
    # the narrow allreduce's: the narrow bits' MPI datatype, which narrow dtype (0: bfloat16,
    # 1: float16), a mean or a sum, this rank's place, and whether a residual comes last
    "wire": lambda k, p, n, d: _dtype_handle(np.uint16),
    "narrow": lambda k, p, n, d: np.int64(p["narrow"]),
    "mean": lambda k, p, n, d: np.int64(p["mean"]),
    "rank": lambda k, p, n, d: np.int64(p["rank"]),
    "size": lambda k, p, n, d: np.int64(p["size"]),
    "feedback": lambda k, p, n, d: np.int64(p["feedback"]),
}


def _empty_where(nothing_back: Callable[[dict[str, Any]], bool]) -> Any:
    def out_aval(a: Any, params: dict[str, Any]) -> ShapedArray:
        return ShapedArray((0,) if nothing_back(params) else a.shape, a.dtype)

    return out_aval


# What a collective returns for one buffer, by the table's `returns`.
OUTPUTS: dict[str, Callable[[Any, dict[str, Any]], ShapedArray]] = {
    "same": lambda a, p: ShapedArray(a.shape, a.dtype),
    "nothing on the root": _empty_where(lambda p: p["is_root"]),
    "nothing off the root": _empty_where(lambda p: not p["is_root"]),
    "stacked": lambda a, p: ShapedArray((p["size"], *a.shape), a.dtype),
}


@dataclasses.dataclass(frozen=True)
class Record(Kind):
    """A collective kind of the table, with what JAX needs of it: its custom call's
    attributes for a buffer and what it returns."""

    def call_attrs(self, params: dict[str, Any], aval: Any) -> dict[str, Any]:
        """Every attribute of one custom call on a buffer of ``aval`` (but ``call``)."""
        nitems = np.int64(np.prod(aval.shape, dtype=np.int64))
        dtype = _dtype_handle(aval.dtype)
        return {name: _ATTRIBUTES[name](self, params, nitems, dtype) for name in self.attributes}

    def out_aval(self, aval: Any, params: dict[str, Any]) -> ShapedArray:
        """What it returns for one buffer of ``aval``."""
        return OUTPUTS[self.returns](aval, params)


def _record(row: Kind) -> Record:
    unknown = [a for a in row.attributes if a not in _ATTRIBUTES]
    if unknown or row.returns not in OUTPUTS:
        msg = (
            f"jaxddp/_native/kinds.py: the {row.kind!r} row names attributes "
            f"{unknown} or an output {row.returns!r} that records.py does not know."
        )
        raise RuntimeError(msg)
    return Record(**{f.name: getattr(row, f.name) for f in dataclasses.fields(row)})


RECORDS = {kind: _record(row) for kind, row in KINDS.items()}
