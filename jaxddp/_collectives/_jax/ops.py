"""The collectives as the rest of jaxddp calls them: lists of flat buffers in, lists out.

Traced inside ``jaxddp.spmd`` with ``JAXDDP_COLLECTIVES=xla`` (:func:`.xla.axis` is set),
each is JAX's own collective over the ranks' mesh axis; everywhere else, an MPI call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from ..._types import Communicator
from . import xla
from .primitives import allgather_p, allreduce_p, alltoall_p, bcast_p, reduce_p
from .records import Handle

__all__ = [
    "allgather_many",
    "allreduce_many",
    "alltoall_many",
    "bcast_many",
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


def allreduce_many(
    xs: Sequence[Any], op: Any, comm: Communicator, calls: Sequence[str] | None = None
) -> list[Any]:
    """Allreduces each array of ``xs`` (dtypes MPI knows) with the MPI op ``op``.

    ``calls``: what each buffer is to the caller (the op asked for, the leaves packed in it),
    which jaxddp's own handler compares across ranks."""
    if not xs:
        return []
    if (name := xla.axis_for(comm)) is not None:
        return xla.allreduce(xs, op, name)
    _register_targets()
    if calls is None:
        return allreduce_p.bind(*xs, op=Handle(op), comm=Handle(comm))
    return allreduce_p.bind(*xs, op=Handle(op), comm=Handle(comm), calls=tuple(calls))


def bcast_many(xs: Sequence[Any], root: int, comm: Communicator) -> list[Any]:
    """Gives every rank ``root``'s values of each array of ``xs``."""
    if not xs:
        return []
    if (name := xla.axis_for(comm)) is not None:
        return xla.bcast(xs, root, name)
    _register_targets()
    is_root = comm.Get_rank() == root
    out = bcast_p.bind(*xs, root=root, comm=Handle(comm), is_root=is_root)
    return _after(xs, out) if is_root else out


def reduce_many(xs: Sequence[Any], op: Any, root: int, comm: Communicator) -> list[Any]:
    """Reduces each array of ``xs`` onto ``root``; the other ranks get their input back."""
    if not xs:
        return []
    if (name := xla.axis_for(comm)) is not None:
        return xla.reduce(xs, op, root, name)
    _register_targets()
    is_root = comm.Get_rank() == root
    out = reduce_p.bind(*xs, op=Handle(op), root=root, comm=Handle(comm), is_root=is_root)
    return out if is_root else _after(xs, out)


def allgather_many(xs: Sequence[Any], comm: Communicator) -> list[Any]:
    """Every rank's values of each array of ``xs``, stacked on a new first axis in rank
    order: ``(size, *x.shape)``."""
    if not xs:
        return []
    if (name := xla.axis_for(comm)) is not None:
        return xla.allgather(xs, name)
    _register_targets()
    return allgather_p.bind(*xs, comm=Handle(comm), size=comm.Get_size())


def alltoall_many(xs: Sequence[Any], comm: Communicator) -> list[Any]:
    """Each array of ``xs`` has the communicator's size as its first axis; row ``j`` goes
    to rank ``j``, and row ``i`` of the result came from rank ``i``."""
    if not xs:
        return []
    size = comm.Get_size()
    for x in xs:
        if x.ndim == 0 or x.shape[0] != size:
            msg = f"Expected alltoall buffers of shape ({size}, ...), got {x.shape} instead."
            raise ValueError(msg)
    if (name := xla.axis_for(comm)) is not None:
        return xla.alltoall(xs, name)
    _register_targets()
    return alltoall_p.bind(*xs, comm=Handle(comm), size=size)


def sum_rows(rows: Any) -> Any:
    """The rows of a ``(size, ...)`` array (NumPy or jax) added in rank order, one after the
    other: ``((rows[0] + rows[1]) + rows[2]) + ...``, the order of the sharded optimizer's
    sum and of the reference the tests compute."""
    total = rows[0]
    for j in range(1, rows.shape[0]):
        total = total + rows[j]
    return total


def reduce_scatter_many(xs: Sequence[Any], op: Any, comm: Communicator) -> list[Any]:
    """Each array of ``xs`` has the communicator's size as its first axis; rank ``r`` gets
    row ``r`` summed over the ranks (the MPI op ``op`` must be MPI's SUM; the arrays are in
    the dtype they are summed in). Through MPI: an alltoall, then :func:`sum_rows` (in rank
    order, the same bits on every path through MPI); inside ``jaxddp.spmd`` with ``xla``,
    ``psum_scatter`` (XLA's order of the sum)."""
    if not xs:
        return []
    if (name := xla.axis_for(comm)) is not None:
        return xla.reduce_scatter(xs, op, name)
    from ..._runtime.world import mpi

    if op != mpi().SUM:
        msg = f"jaxddp's reduce-scatter sums only; it got the MPI op {op!r}."
        raise NotImplementedError(msg)
    return [sum_rows(rows) for rows in alltoall_many(xs, comm)]
