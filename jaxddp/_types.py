"""The types jaxddp's signatures name, defined once.

``PyTree`` is any nesting of lists, tuples, dicts, dataclasses and other registered nodes
whose leaves are arrays or numbers (it stays ``Any`` to the type checker, as in JAX: a
pytree has no static type). ``ReduceOp`` is a reduction jaxddp's collectives accept.
``Communicator`` is an mpi4py communicator, named without importing mpi4py at run time (the
launcher check must run before MPI starts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypeAlias

__all__ = ["Communicator", "PyTree", "ReduceOp"]

PyTree: TypeAlias = Any
ReduceOp: TypeAlias = Literal["sum", "mean", "max", "min"]

if TYPE_CHECKING:
    from mpi4py import MPI

    Communicator: TypeAlias = MPI.Comm
else:
    Communicator = Any
