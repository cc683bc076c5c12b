"""jaxddp's collectives as JAX's own, for a step that ``jaxddp.spmd`` runs over the ranks' mesh.

While ``jaxddp.spmd`` traces a step, :func:`active` gives the :class:`Xla` implementation
made for that trace, which :mod:`.ops` calls instead of the MPI path's: ``psum``, ``pmax``,
``pmin``, ``all_gather`` and ``all_to_all`` over the ranks' mesh axis (:func:`axis`), as the
table's ``xla`` column says (``jaxddp/_native/kinds.py``). XLA runs them itself (NCCL on
GPUs, gloo across processes on CPUs) and may overlap them with the rest of the step. Outside such a trace :func:`active` is None and
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

from ..._native.kinds import KINDS
from . import narrow, order

__all__ = ["AXIS", "Xla", "active", "axis", "bound", "describe", "transport"]

AXIS = "jaxddp_ranks"  # the mesh axis of the ranks, one device per rank, in rank order


class Xla:
    """The collectives of one ``jaxddp.spmd`` step's trace: JAX's own over the mesh axis
    ``axis``, one method per kind of the table (``jaxddp/_native/kinds.py``: its ``xla``
    column says which of JAX's collectives each is), with the signatures of the MPI path's
    (:class:`.ops.Mpi`). Made once per trace (:func:`bound`); none of the MPI path's work
    (its FFI targets, its handles) is done here."""

    def __init__(self, axis: str) -> None:
        self.axis = axis

    def allreduce(
        self, xs: Sequence[Any], op: Any, comm: Any, calls: Sequence[str] | None = None
    ) -> list[Any]:
        """Every rank's ``xs`` reduced with the MPI op ``op`` (sum, max or min).

        A maximum or minimum of floats is reduced as :mod:`.order`'s integer keys, as on the
        MPI path: ``pmax`` alone drops a NaN held by another rank and picks either zero where
        ranks hold -0.0 and +0.0; the keys make a NaN on any rank the result and
        -0.0 < +0.0, with the MPI path's bits (two elementwise conversions, one integer
        ``pmax``)."""
        reducer = _reducer(op)
        if reducer is jax.lax.psum:
            return [reducer(x, self.axis) for x in xs]
        largest = reducer is jax.lax.pmax
        out = []
        for x in xs:
            if np.dtype(x.dtype) in order.KEY_TYPES:
                keys = reducer(order.keys(x, largest), self.axis)
                out.append(order.floats(keys, x.dtype))
            else:
                out.append(reducer(x, self.axis))
        return out

    def bcast(self, xs: Sequence[Any], root: int, comm: Any) -> list[Any]:
        """``root``'s values of each array: gathered and picked, so that every bit (a
        negative zero, a NaN's payload) arrives as it left."""
        return [jax.lax.all_gather(x, self.axis)[root] for x in xs]

    def reduce(self, xs: Sequence[Any], op: Any, root: int, comm: Any) -> list[Any]:
        """The reduction of each array on ``root``; every other rank gets its own input back.

        Every rank runs the same program: the choice is made on the rank's position on the
        mesh, not on a Python value that would differ between the ranks' programs."""
        reduced = self.allreduce(xs, op, comm)
        here = jax.lax.axis_index(self.axis) == root
        return [jnp.where(here, r, x) for r, x in zip(reduced, xs, strict=True)]

    def allgather(self, xs: Sequence[Any], comm: Any) -> list[Any]:
        """Every rank's values of each array, stacked on a new first axis in rank order."""
        return [jax.lax.all_gather(x, self.axis) for x in xs]

    def alltoall(self, xs: Sequence[Any], comm: Any) -> list[Any]:
        """Row ``j`` of each array goes to rank ``j``; row ``i`` of the result came from
        rank ``i``."""
        return [jax.lax.all_to_all(x, self.axis, 0, 0) for x in xs]

    def reduce_scatter(self, xs: Sequence[Any], op: Any, comm: Any) -> list[Any]:
        """Row ``r`` of each ``(size, ...)`` array summed over the ranks, on rank ``r``: JAX's
        ``psum_scatter`` (a sum only: the MPI op ``op`` must be MPI's SUM)."""
        if _reducer(op) is not jax.lax.psum:
            msg = f"jaxddp.spmd has no XLA reduce-scatter for the MPI op {op!r}; only a sum."
            raise NotImplementedError(msg)
        return [jax.lax.psum_scatter(x, self.axis, scatter_dimension=0, tiled=False) for x in xs]

    def narrow_allreduce(
        self, xs: Sequence[Any], residual: Any, dtype: Any, mean: bool, comm: Any
    ) -> tuple[list[Any], Any]:
        """The narrow allreduce of gradient compression as :func:`.narrow.composed` of
        ``all_to_all`` and ``all_gather`` of the narrow bits."""
        return narrow.composed(
            xs,
            residual,
            dtype,
            mean,
            alltoall=lambda x: jax.lax.all_to_all(x, self.axis, 0, 0),
            allgather=lambda x: jax.lax.all_gather(x, self.axis),
            size=comm.Get_size(),
            me=jax.lax.axis_index(self.axis),
        )


_active: contextvars.ContextVar[Xla | None] = contextvars.ContextVar(
    "jaxddp_collectives", default=None
)


def axis() -> str | None:
    """The ranks' mesh axis while ``jaxddp.spmd`` traces a step, else None."""
    xla = _active.get()
    return None if xla is None else xla.axis


def active(comm: Any) -> Xla | None:
    """The XLA implementation of the collectives over ``comm`` while ``jaxddp.spmd`` traces
    a step, else None (an MPI call). The mesh spans the world in rank order, so a collective
    over another communicator (a subgroup, another order) is refused there."""
    xla = _active.get()
    if xla is None:
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
    return xla


@contextlib.contextmanager
def bound(name: str) -> Iterator[None]:
    """Within it, jaxddp's traced collectives over the world run over the mesh axis ``name``:
    the XLA implementation, chosen once for the trace."""
    token = _active.set(Xla(name))
    try:
        yield
    finally:
        _active.reset(token)


def transport(backend: str) -> str:
    """What moves the bytes of a ``jaxddp.spmd`` step's collectives on ``backend``."""
    known = {"cpu": "gloo", "gpu": "NCCL", "cuda": "NCCL"}
    return known.get(backend, f"the {backend} backend's own collectives")


def describe(backend: str) -> str:
    """What a ``jaxddp.spmd`` step's collectives are on ``backend`` (``jaxddp doctor``)."""
    kinds = "; ".join(f"{row.name}: {row.xla}" for row in KINDS.values())
    return (
        f"steps in jaxddp.spmd take JAX's own collectives over the ranks' mesh, run by XLA "
        f"through {transport(backend)} ({backend}, one device per rank): {kinds}"
    )


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
