"""The collectives as the rest of jaxddp calls them: lists of flat buffers in, lists out.

Each wrapper asks :func:`implementation` which implementation runs it and calls its method
of the same kind: :class:`Mpi` (jaxddp's primitives, MPI calls), or, while ``jaxddp.spmd``
traces a step with ``JAXDDP_COLLECTIVES=xla``, the :class:`.xla.Xla` made for that trace
(JAX's own collectives over the ranks' mesh axis)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ... import _native
from ..._native.kinds import KINDS
from ..._types import Communicator
from . import narrow, xla
from .primitives import COLLECTIVES, allgather_p, allreduce_p, alltoall_p, bcast_p, reduce_p
from .records import Handle

__all__ = [
    "MPI_PATH",
    "Mpi",
    "allgather_many",
    "allreduce_many",
    "alltoall_many",
    "bcast_many",
    "implementation",
    "narrow_allreduce",
    "reduce_many",
    "reduce_scatter_many",
    "sum_rows",
]


def _after(xs: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
    """``xs``, made to depend on ``outs`` so that no rank's dead-code elimination drops the
    collective that made ``outs`` (a root's broadcast, a non-root's reduce), even inside a
    nested ``jit`` whose outputs would otherwise be its forwarded inputs."""
    return list(jax.lax.optimization_barrier((list(xs), list(outs)))[0])


def _register_targets() -> None:
    """Imports mpi4jax, whose import registers the FFI targets jaxddp's lowerings call."""
    import mpi4jax  # noqa: F401


class Mpi:
    """The collectives of the MPI path: jaxddp's primitives (:mod:`.primitives`), lowered to
    mpi4jax's FFI targets or jaxddp's own handlers. One method per kind of the table
    (``jaxddp/_native/kinds.py``), as :class:`.xla.Xla` has."""

    def allreduce(
        self, xs: Sequence[Any], op: Any, comm: Communicator, calls: Sequence[str] | None = None
    ) -> list[Any]:
        _register_targets()
        if calls is None:
            return allreduce_p.bind(*xs, op=Handle(op), comm=Handle(comm))
        return allreduce_p.bind(*xs, op=Handle(op), comm=Handle(comm), calls=tuple(calls))

    def bcast(self, xs: Sequence[Any], root: int, comm: Communicator) -> list[Any]:
        _register_targets()
        is_root = comm.Get_rank() == root
        out = bcast_p.bind(*xs, root=root, comm=Handle(comm), is_root=is_root)
        return _after(xs, out) if is_root else out

    def reduce(self, xs: Sequence[Any], op: Any, root: int, comm: Communicator) -> list[Any]:
        _register_targets()
        is_root = comm.Get_rank() == root
        out = reduce_p.bind(*xs, op=Handle(op), root=root, comm=Handle(comm), is_root=is_root)
        return out if is_root else _after(xs, out)

    def allgather(self, xs: Sequence[Any], comm: Communicator) -> list[Any]:
        _register_targets()
        return allgather_p.bind(*xs, comm=Handle(comm), size=comm.Get_size())

    def alltoall(self, xs: Sequence[Any], comm: Communicator) -> list[Any]:
        _register_targets()
        return alltoall_p.bind(*xs, comm=Handle(comm), size=comm.Get_size())

    def reduce_scatter(self, xs: Sequence[Any], op: Any, comm: Communicator) -> list[Any]:
        """An alltoall, then :func:`sum_rows` (in rank order: the same bits on every path
        through MPI)."""
        from ..._runtime.world import mpi

        if op != mpi().SUM:
            msg = f"jaxddp's reduce-scatter sums only; it got the MPI op {op!r}."
            raise NotImplementedError(msg)
        return [sum_rows(rows) for rows in self.alltoall(xs, comm)]

    def narrow_allreduce(
        self, xs: Sequence[Any], residual: Any, dtype: Any, mean: bool, comm: Communicator
    ) -> tuple[list[Any], Any]:
        """jaxddp's own CPU handler where every rank agreed on jaxddp's handlers (and the
        step is for CPU), else :func:`.narrow.composed` of this path's alltoall and
        allgather (a GPU's staged handlers, or mpi4jax's)."""
        size, rank = comm.Get_size(), comm.Get_rank()
        native = _native.narrow_target() is not None and not _native.cpu_staged()
        if native and jax.default_backend() == "cpu":
            feedback = residual is not None
            out = COLLECTIVES["narrow_allreduce"].bind(
                *xs,
                *([residual] if feedback else []),
                comm=Handle(comm),
                narrow=narrow.CODES[np.dtype(dtype)],
                mean=bool(mean),
                rank=rank,
                size=size,
                feedback=feedback,
            )
            return list(out[: len(xs)]), out[-1] if feedback else None
        return narrow.composed(
            xs,
            residual,
            dtype,
            mean,
            alltoall=lambda x: self.alltoall([x], comm)[0],
            allgather=lambda x: self.allgather([x], comm)[0],
            size=size,
            me=rank,
        )


MPI_PATH = Mpi()

# Both implementations have every kind of the table (and the reduce-scatter built on them).
for _implementation in (Mpi, xla.Xla):
    for _kind in (*KINDS, "reduce_scatter"):
        if not callable(getattr(_implementation, _kind, None)):
            msg = f"{_implementation.__qualname__} has no {_kind}, a kind of _native/kinds.py"
            raise TypeError(msg)


def implementation(comm: Communicator) -> Mpi | xla.Xla:
    """The implementation of the collectives over ``comm`` here: the XLA one that
    ``jaxddp.spmd`` chose for the step it traces (``JAXDDP_COLLECTIVES=xla``), else MPI's."""
    return xla.active(comm) or MPI_PATH


def allreduce_many(
    xs: Sequence[Any], op: Any, comm: Communicator, calls: Sequence[str] | None = None
) -> list[Any]:
    """Allreduces each array of ``xs`` (dtypes MPI knows) with the MPI op ``op``.

    ``calls``: what each buffer is to the caller (the op asked for, the leaves packed in it),
    which jaxddp's own handler compares across ranks."""
    return implementation(comm).allreduce(xs, op, comm, calls) if xs else []


def bcast_many(xs: Sequence[Any], root: int, comm: Communicator) -> list[Any]:
    """Gives every rank ``root``'s values of each array of ``xs``."""
    return implementation(comm).bcast(xs, root, comm) if xs else []


def reduce_many(xs: Sequence[Any], op: Any, root: int, comm: Communicator) -> list[Any]:
    """Reduces each array of ``xs`` onto ``root``; the other ranks get their input back."""
    return implementation(comm).reduce(xs, op, root, comm) if xs else []


def allgather_many(xs: Sequence[Any], comm: Communicator) -> list[Any]:
    """Every rank's values of each array of ``xs``, stacked on a new first axis in rank
    order: ``(size, *x.shape)``."""
    return implementation(comm).allgather(xs, comm) if xs else []


def _rows(xs: Sequence[Any], comm: Communicator) -> None:
    size = comm.Get_size()
    for x in xs:
        if x.ndim == 0 or x.shape[0] != size:
            msg = f"Expected alltoall buffers of shape ({size}, ...), got {x.shape} instead."
            raise ValueError(msg)


def alltoall_many(xs: Sequence[Any], comm: Communicator) -> list[Any]:
    """Each array of ``xs`` has the communicator's size as its first axis; row ``j`` goes
    to rank ``j``, and row ``i`` of the result came from rank ``i``."""
    if not xs:
        return []
    _rows(xs, comm)
    return implementation(comm).alltoall(xs, comm)


def sum_rows(rows: Any) -> Any:
    """The rows of a ``(size, ...)`` array (NumPy or jax) added in rank order, one after the
    other: ``((rows[0] + rows[1]) + rows[2]) + ...``, the order of the sharded optimizer's
    sum and of the reference the tests compute."""
    total = rows[0]
    for j in range(1, rows.shape[0]):
        total = total + rows[j]
    return total


def narrow_allreduce(
    xs: Sequence[Any], residual: Any, dtype: Any, mean: bool, comm: Communicator
) -> tuple[list[Any], Any]:
    """The float32 arrays ``xs`` summed (or averaged: ``mean``) over the ranks while they
    travel as ``dtype`` (bfloat16 or float16), after this rank's ``residual`` (one float32
    vector of their total length, or None) is added to them; and with a residual, this
    rank's error of the two roundings (:mod:`.narrow`), what error feedback carries to the
    next step (else None)."""
    if not xs:
        return [], residual
    return implementation(comm).narrow_allreduce(xs, residual, dtype, mean, comm)


def reduce_scatter_many(xs: Sequence[Any], op: Any, comm: Communicator) -> list[Any]:
    """Each array of ``xs`` has the communicator's size as its first axis; rank ``r`` gets
    row ``r`` summed over the ranks (the MPI op ``op`` must be MPI's SUM; the arrays are in
    the dtype they are summed in). Through MPI: an alltoall, then :func:`sum_rows` (in rank
    order, the same bits on every path through MPI); inside ``jaxddp.spmd`` with ``xla``,
    ``psum_scatter`` (XLA's order of the sum)."""
    return implementation(comm).reduce_scatter(xs, op, comm) if xs else []
