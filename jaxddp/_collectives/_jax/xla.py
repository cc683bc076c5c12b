"""jaxddp's collectives as JAX's own, for a step that ``jaxddp.spmd`` runs over the ranks' mesh.

While ``jaxddp.spmd`` traces a step, :func:`axis` names the mesh axis of the ranks, and
:mod:`.ops` emits ``psum``, ``pmax``, ``pmin``, ``all_gather`` and ``all_to_all`` over it
instead of MPI calls: XLA runs them itself (NCCL on GPUs, gloo across processes on CPUs) and
may overlap them with the rest of the step. Outside such a trace :func:`axis` is None and
nothing here is used. The context is a :class:`contextvars.ContextVar`, so a trace on
another thread (a background save, a loader) never sees it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import order

__all__ = [
    "AXIS",
    "allgather",
    "allreduce",
    "alltoall",
    "axis",
    "axis_for",
    "bcast",
    "bound",
    "reduce",
    "reduce_scatter",
]

AXIS = "jaxddp_ranks"  # the mesh axis of the ranks, one device per rank, in rank order

_axis: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxddp_axis", default=None)


def axis() -> str | None:
    """The ranks' mesh axis while ``jaxddp.spmd`` traces a step, else None."""
    return _axis.get()


def axis_for(comm: Any) -> str | None:
    """The mesh axis to run a collective over ``comm`` on, or None (not inside
    ``jaxddp.spmd``: an MPI call). The mesh spans the world in rank order, so a collective
    over another communicator (a subgroup, another order) is refused there."""
    name = _axis.get()
    if name is None:
        return None
    from ..._runtime.world import jax_comm

    if comm is not jax_comm():
        msg = (
            "A jaxddp collective with `comm=` another communicator than the world's was "
            "called inside a step wrapped in `jaxddp.spmd` with JAXDDP_COLLECTIVES=xla, "
            "where collectives run over the mesh of every rank. Call it outside the wrapped "
            "step (a separate `jax.jit`), or leave `comm` unset, or unset JAXDDP_COLLECTIVES."
        )
        raise NotImplementedError(msg)
    return name


@contextlib.contextmanager
def bound(name: str) -> Iterator[None]:
    """Within it, jaxddp's traced collectives over the world run over the mesh axis ``name``."""
    token = _axis.set(name)
    try:
        yield
    finally:
        _axis.reset(token)


def _reducer(op: Any) -> Any:
    from ..._runtime.world import mpi

    MPI = mpi()
    if op == MPI.SUM:
        return jax.lax.psum
    if op == MPI.MAX:
        return jax.lax.pmax
    if op == MPI.MIN:
        return jax.lax.pmin
    msg = f"jaxddp.spmd has no XLA collective for the MPI op {op!r}."
    raise NotImplementedError(msg)


def allreduce(xs: Sequence[Any], op: Any, name: str) -> list[Any]:
    """Every rank's ``xs`` reduced with the MPI op ``op`` (sum, max or min).

    A maximum or minimum of floats is reduced as :mod:`.order`'s integer keys, as on the MPI
    path: ``pmax`` alone drops a NaN held by another rank and picks either zero where ranks
    hold -0.0 and +0.0; the keys make a NaN on any rank the result and -0.0 < +0.0, with the
    MPI path's bits (two elementwise conversions, one integer ``pmax``)."""
    reducer = _reducer(op)
    if reducer is jax.lax.psum:
        return [reducer(x, name) for x in xs]
    largest = reducer is jax.lax.pmax
    out = []
    for x in xs:
        if np.dtype(x.dtype) in order.KEY_TYPES:
            out.append(order.floats(reducer(order.keys(x, largest), name), x.dtype))
        else:
            out.append(reducer(x, name))
    return out


def allgather(xs: Sequence[Any], name: str) -> list[Any]:
    """Every rank's values of each array, stacked on a new first axis in rank order."""
    return [jax.lax.all_gather(x, name) for x in xs]


def bcast(xs: Sequence[Any], root: int, name: str) -> list[Any]:
    """``root``'s values of each array: gathered and picked, so that every bit (a negative
    zero, a NaN's payload) arrives as it left."""
    return [jax.lax.all_gather(x, name)[root] for x in xs]


def reduce(xs: Sequence[Any], op: Any, root: int, name: str) -> list[Any]:
    """The reduction of each array on ``root``; every other rank gets its own input back.

    Every rank runs the same program: the choice is made on the rank's position on the
    mesh, not on a Python value that would differ between the ranks' programs."""
    reduced = allreduce(xs, op, name)
    here = jax.lax.axis_index(name) == root
    return [jnp.where(here, r, x) for r, x in zip(reduced, xs, strict=True)]


def alltoall(xs: Sequence[Any], name: str) -> list[Any]:
    """Row ``j`` of each array goes to rank ``j``; row ``i`` of the result came from rank ``i``."""
    return [jax.lax.all_to_all(x, name, 0, 0) for x in xs]


def reduce_scatter(xs: Sequence[Any], op: Any, name: str) -> list[Any]:
    """Row ``r`` of each ``(size, ...)`` array summed over the ranks, on rank ``r``: JAX's
    ``psum_scatter`` (a sum only: the MPI op ``op`` must be MPI's SUM)."""
    if _reducer(op) is not jax.lax.psum:
        msg = f"jaxddp.spmd has no XLA reduce-scatter for the MPI op {op!r}; only a sum."
        raise NotImplementedError(msg)
    return [jax.lax.psum_scatter(x, name, scatter_dimension=0, tiled=False) for x in xs]
