"""Every collective kind jaxddp stages, defined once, in :data:`KINDS`.

The rest reads this table: the records of the traced collectives (their primitives, FFI
calls and rules: ``_collectives/_jax/records.py``), the staged handlers this package
registers and the MPI functions it hands them (:mod:`.staged`, ``__init__.py``), and the two
implementations of a collective inside a jitted step: MPI's (``_collectives/_jax/ops.py``)
and JAX's own inside ``jaxddp.spmd`` with ``JAXDDP_COLLECTIVES=xla``
(``_collectives/_jax/xla.py``), each checked at import to have every kind. The compiled
handlers (``staged.cc``) are checked against it where they are loaded: a handler whose
attributes differ from its row is not used, and the reason names the kind.

Adding a collective: a row here, its wrapper and MPI method in ``_collectives/_jax/ops.py``,
its XLA method in ``_collectives/_jax/xla.py``; for GPUs, its staged handler in
``staged.cc`` and, where it calls an MPI function no other kind calls, that function's line in
``native.h`` (``_collectives/_jax/README.md``).
"""

from __future__ import annotations

import dataclasses

__all__ = ["KINDS", "Kind"]


@dataclasses.dataclass(frozen=True)
class Kind:
    """A collective kind, as every part of jaxddp that stages, lowers or runs one sees it."""

    kind: str  # its primitives are jaxddp_<kind>; its staged handler jaxddp_staged_<kind>
    name: str  # as its errors call it
    target: str  # the FFI target mpi4jax registers for it
    attributes: tuple[str, ...]  # its custom call's attributes (mpi4jax's and the staged handler's)
    mpi_function: str  # the nonblocking MPI function its staged (else its CPU) handler calls
    xla: str  # what it is inside jaxddp.spmd with JAXDDP_COLLECTIVES=xla: JAX's own collective
    returns: str = "same"  # its output per buffer: see records.py's OUTPUTS
    described: bool = False  # jaxddp's own handlers also take `call`: the call as made
    native: bool = False  # on CPU, jaxddp's own handler where every rank loaded it
    differentiable: bool = False  # jvp and transpose as `jax.lax.psum`'s (else: refused)
    batchable: bool = False  # elementwise: vmap passes through it
    rows: bool = False  # its buffer holds one row per rank: MPI's counts are a row's
    staged: bool = True  # it has a staged handler (staged.cc) for programs for a GPU
    one_call: bool = False  # all its buffers go in one custom call (else one call each)

    def handler_attributes(self) -> tuple[str, ...]:
        """The attributes jaxddp's own handler of this kind takes (``staged.cc`` binds them)."""
        return (*self.attributes, *(("call",) if self.described else ()))


_MOVE = ("comm", "sendcount", "sendtype", "recvcount", "recvtype")

KINDS: dict[str, Kind] = {
    row.kind: row
    for row in (
        Kind(
            "allreduce",
            "allreduce",
            "mpi_allreduce_ffi",
            ("comm", "op", "dtype", "nitems"),
            "MPI_Iallreduce",
            "psum, pmax or pmin",
            described=True,
            native=True,
            differentiable=True,
            batchable=True,
        ),
        # a broadcast's root and a reduce's non-roots get nothing back (their input stands)
        Kind(
            "bcast",
            "broadcast",
            "mpi_bcast_ffi",
            ("comm", "dtype", "nitems", "root"),
            "MPI_Ibcast",
            "all_gather, then the root's row",
            returns="nothing on the root",
        ),
        Kind(
            "reduce",
            "reduce",
            "mpi_reduce_ffi",
            ("comm", "dtype", "nitems", "op", "root"),
            "MPI_Ireduce",
            "psum, pmax or pmin, kept on the root",
            returns="nothing off the root",
        ),
        # Moves only (for the sharded optimizer), with the communicator's `size` in their
        # params: an allgather stacks every rank's buffer on a new first axis...
        Kind(
            "allgather",
            "allgather",
            "mpi_allgather_ffi",
            _MOVE,
            "MPI_Iallgather",
            "all_gather",
            returns="stacked",
        ),
        # ...an alltoall sends row j of its (size, ...) input to rank j, gets row i from i.
        Kind(
            "alltoall",
            "alltoall",
            "mpi_alltoall_ffi",
            _MOVE,
            "MPI_Ialltoall",
            "all_to_all",
            rows=True,
        ),
        # Gradient compression's narrow allreduce (bfloat16 or float16 on the wire), on CPU
        # only, jaxddp's own handler (narrow.cc): float32 leaves (then, with feedback, this
        # rank's residual) in one call; their mean or sum (then this rank's error) back.
        # Elsewhere (a GPU, the xla path, no handler) it is the composition of an alltoall
        # and an allgather of the narrow bits (_collectives/_jax/narrow.py).
        Kind(
            "narrow_allreduce",
            "narrow allreduce",
            "jaxddp_narrow_allreduce",
            ("comm", "wire", "narrow", "mean", "rank", "size", "feedback"),
            "MPI_Ialltoall",
            "all_to_all and all_gather of the narrow bits, a float32 sum between",
            native=True,
            staged=False,
            one_call=True,
        ),
    )
}
