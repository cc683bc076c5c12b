"""Gradients that travel narrow: a cast to bfloat16 or float16, or PowerSGD; with error feedback.

:func:`jaxddp.allreduce_gradients` with ``compression=`` runs :func:`compressed_allreduce`.
The leaves it compresses (floats of at most 32 bits; for PowerSGD, only the matrices it pays
to factor) are packed into one float32 vector and ``residual`` (this rank's error of the
previous steps) is added to it. The other leaves (integers, float64, complex, PowerSGD's
vectors and small matrices) are reduced exactly, as without compression.

A cast (``"bf16"``, ``"fp16"``) is jaxddp's narrow allreduce (``_collectives/_jax/narrow.py``:
a reduce-scatter and an allgather of its own, both in the narrow dtype, since MPI's own
float16 sum is software, slower than float32): each rank casts its vector, cuts it into ``W``
blocks and sends block ``r`` to rank ``r`` (an alltoall of the narrow bits); rank ``r`` adds
the ``W`` blocks it got in float32, in rank order, multiplies by ``1/W`` for a mean, rounds the
result once to the narrow dtype and sends it to everyone (an allgather of the narrow bits).
Twice the narrow bytes of the vector cross the wire per rank (``2 (W - 1) / W`` of it), half
of a float32 allreduce's. Two roundings happen: each rank's cast of its own vector, and rank
``r``'s rounding of block ``r``'s sum; both go into the residual (the first into every
rank's, the second into the owner's, times ``W`` for a mean), so nothing is lost for good:
what one step rounds away the next one sends. On CPU, jaxddp's own handler
(``_native/narrow.cc``) does the same arithmetic in chunks, rounding the next chunk while the
last ones travel.

PowerSGD (Vogels et al., 2019) approximates each such matrix ``M`` (a leaf of shape
``(n, *rest)`` as ``(n, prod(rest))``, plus its residual) as ``P Q^T`` of rank ``r``:
``P = M Q`` with last step's ``Q`` (warm start), allreduced (with the exact leaves, in one
call) and orthonormalized, then ``Q = M^T P``, allreduced. ``(n + m) r`` float32 numbers cross
the wire instead of ``n m``. Each rank's residual is its ``M`` minus the mean's approximation.

The residual differs between the ranks: it is kept as a :class:`~jaxddp.ShardedState` of one
vector per rank, which :class:`jaxddp.CheckpointManager` saves as each rank's own and
restores into the same rank (at the same world size).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from .._collectives import api as _comm
from .._collectives import signature as _signature
from .._collectives._jax import ops
from .._types import Communicator, ReduceOp
from .zero.state import ShardedState, Slicing

__all__ = [
    "CASTS",
    "CompressionState",
    "PowerSGD",
    "check_compression",
    "compressed_allreduce",
]

CASTS = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """PowerSGD compression (Vogels et al., NeurIPS 2019) for ``allreduce_gradients``.

    Each gradient matrix (a leaf of two or more dimensions, seen as ``(n, m)`` with ``n`` its
    leading axis) travels as two float32 factors, ``P`` of shape ``(n, rank)`` and ``Q`` of
    shape ``(m, rank)``, in two allreduces per step shared by all matrices; ``Q`` starts from
    the previous step's (warm start), so one power iteration per step suffices. Vectors,
    scalars and matrices where ``(n + m) * rank`` is more than ``n * m / min_compression_rate``
    travel exactly, at full width. With error feedback (the default) each rank keeps what the
    approximation missed and adds it to its next gradient.

    Args:
      rank: the rank of the approximation, a positive integer: 1 to 4 usually trains like
        the uncompressed run; more costs more bytes and compute.
      start_step: the number of steps reduced exactly, at full width, before compression
        starts (PyTorch's ``start_powerSGD_iter``): 0 compresses from the first step.
      min_compression_rate: compress a matrix only where it shrinks by at least this factor.
      seed: the seed of the first ``Q`` (the same on every rank).

    Example:
      >>> import jaxddp
      >>> tx = jaxddp.allreduce_gradients(compression=jaxddp.PowerSGD(rank=4))
    """

    rank: int = 4
    start_step: int = 0
    min_compression_rate: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "start_step", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                msg = f"Expected `{name}` of PowerSGD to be an integer, got {value!r} instead."
                raise TypeError(msg)
        if self.rank < 1:
            msg = f"Expected `rank` of PowerSGD to be a positive integer, got {self.rank} instead."
            raise ValueError(msg)
        if self.start_step < 0:
            msg = (
                f"Expected `start_step` of PowerSGD to be 0 or more, got {self.start_step} instead."
            )
            raise ValueError(msg)
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate >= 1:
            msg = (
                "Expected `min_compression_rate` of PowerSGD to be a number >= 1, got "
                f"{rate!r} instead."
            )
            raise ValueError(msg)


Compression = str | PowerSGD


def check_compression(compression: Any) -> Compression | None:
    """``compression`` as ``allreduce_gradients`` takes it, or the error every rank raises."""
    if compression is None or isinstance(compression, PowerSGD):
        return compression
    if isinstance(compression, str):
        if compression in CASTS:
            return compression
        msg = (
            "Expected `compression` to be None, 'bf16', 'fp16' or jaxddp.PowerSGD(rank=...), "
            f"got {compression!r} instead."
        )
        raise ValueError(msg)
    msg = (
        "Expected `compression` to be None, 'bf16', 'fp16' or jaxddp.PowerSGD(rank=...), got "
        f"a {type(compression).__name__} instead."
    )
    raise TypeError(msg)


class CompressionState(NamedTuple):
    """The state of ``allreduce_gradients(compression=...)``.

    Attributes:
      count: the number of updates made (PowerSGD's ``start_step`` counts them).
      residual: this rank's error feedback, one float32 vector of the compressed leaves'
        elements, as a :class:`~jaxddp.ShardedState` (it differs between the ranks); ``()``
        without error feedback.
      q: PowerSGD's ``Q`` per compressed matrix, the same on every rank; ``()`` for a cast.
    """

    count: Any
    residual: Any
    q: Any


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Which leaves are compressed (their indices, as ``(n, m)`` matrices for PowerSGD)."""

    compressed: tuple[int, ...]
    matrices: tuple[tuple[int, int, int], ...]  # PowerSGD: (n, m, rank) per compressed leaf
    length: int  # elements of the compressed leaves


def _narrowable(leaf: Any) -> bool:
    dtype = np.dtype(leaf.dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize <= 4


def _plan(leaves: list[Any], compression: Compression) -> _Plan:
    compressed, matrices, length = [], [], 0
    for i, leaf in enumerate(leaves):
        if not _narrowable(leaf):
            continue
        shape = tuple(np.shape(leaf))
        if isinstance(compression, PowerSGD):
            if len(shape) < 2:
                continue
            n, m = shape[0], int(np.prod(shape[1:]))
            r = min(compression.rank, n, m)
            if (n + m) * r * compression.min_compression_rate > n * m:
                continue
            matrices.append((n, m, r))
        compressed.append(i)
        length += int(np.prod(shape))
    return _Plan(tuple(compressed), tuple(matrices), length)


def _residual(vector: Any, size: int) -> ShardedState:
    # every rank's vector a "slice" of their concatenation: the checkpoint saves each its own
    slicing = Slicing(lengths=(vector.shape[0] * size,), size=size, groups=(0,))
    return ShardedState((vector,), slicing)


def init_state(params: Any, compression: Compression, error_feedback: bool, size: int) -> Any:
    leaves = jax.tree_util.tree_leaves(params)
    plan = _plan(leaves, compression)
    residual = (
        _residual(jnp.zeros((plan.length,), jnp.float32), size)
        if error_feedback and plan.length
        else ()
    )
    q: Any = ()
    if isinstance(compression, PowerSGD):
        key = jax.random.key(compression.seed)
        q = tuple(
            jax.random.normal(jax.random.fold_in(key, j), (m, r), jnp.float32)
            for j, (_, m, r) in enumerate(plan.matrices)
        )
    return CompressionState(jnp.zeros((), jnp.int32), residual, q)


def _describe(compression: Compression, error_feedback: bool) -> str:
    name = repr(compression) if isinstance(compression, str) else str(compression)
    return f"compression={name}, error_feedback={error_feedback}"


def _orthonormal(p: Any) -> Any:
    return jnp.linalg.qr(p, mode="reduced")[0]


def compressed_allreduce(
    updates: list[Any],
    state: CompressionState,
    *,
    compression: Compression,
    error_feedback: bool,
    op: ReduceOp,
    comm: Communicator | None,
    check: bool,
    tree: Any,
    treedef: Any,
) -> tuple[list[Any], CompressionState]:
    """The reduced leaves (``updates``, filled, flattened) and the next state."""
    _, size, jax_comm, host_comm = _comm.channels(comm)
    concrete = not any(isinstance(x, Tracer) for x in updates)
    if size > 1:
        _signature.check_call(
            host_comm,
            "allreduce",
            what="gradient tree",
            check=check,
            traced=not concrete,
            op=f"{op}, {_describe(compression, error_feedback)}",
            tree=tree,
            flat=(updates, treedef),
        )
    leaves = [jnp.asarray(x) for x in updates]
    plan = _plan(leaves, compression)
    _check_state(state, plan, compression, error_feedback, size)
    count = state.count + 1
    if size == 1:  # nothing travels: exact
        return leaves, state._replace(count=count)
    exact = [i for i in range(len(leaves)) if i not in set(plan.compressed)]
    wide = [leaves[i].astype(jnp.float32) for i in plan.compressed]
    residual = state.residual.inner[0] if error_feedback and plan.length else None
    if isinstance(compression, str):
        out = _comm.reduce_all([leaves[i] for i in exact], op, comm=comm, check=False)
        # the leaves and the residual go as they are (on CPU, jaxddp's handler reads them
        # where they lie); its error is finite already (an infinity or a NaN is the step's
        # result, as without compression, not a debt to carry)
        reduced, error = ops.narrow_allreduce(
            wide, residual, CASTS[compression], op == "mean", jax_comm
        )
        q = state.q
    else:
        reduced, error, out, q = _powersgd(
            wide, residual, state, compression, plan=plan, others=[leaves[i] for i in exact],
            op=op, comm=comm, size=size,
        )  # fmt: skip
    results = list(leaves)
    for i, x in zip(plan.compressed, reduced, strict=True):
        results[i] = x.astype(leaves[i].dtype)
    narrow = [j for j, i in enumerate(plan.compressed) if leaves[i].dtype != jnp.float32]
    if residual is not None and narrow:
        # a bfloat16 or float16 leaf's own rounding of the result, the same on every rank (a
        # float32 leaf has none: where all are float32 the error is not passed over again)
        lost = [
            jnp.ravel(x - results[i].astype(jnp.float32))
            if j in narrow
            else jnp.zeros(x.size, jnp.float32)
            for j, (i, x) in enumerate(zip(plan.compressed, reduced, strict=True))
        ]
        error = error + jnp.concatenate(lost) / (size if op == "sum" else 1)
    for i, x in zip(exact, out, strict=True):
        results[i] = x
    if residual is None:
        return results, state._replace(count=count, q=q)
    if narrow or not isinstance(compression, str):
        error = jnp.where(jnp.isfinite(error), error, 0.0)  # (as above)
    return results, CompressionState(count, _residual(error, size), q)


def _powersgd(
    wide: list[Any],
    residual: Any,
    state: CompressionState,
    psgd: PowerSGD,
    *,
    plan: _Plan,
    others: list[Any],
    op: ReduceOp,
    comm: Any,
    size: int,
) -> tuple[list[Any], Any, list[Any], Any]:
    """PowerSGD's step from ``start_step`` on, full width before: the reduced compressed
    leaves, this rank's error, the exact leaves (``others``) reduced, and the next ``Q``."""
    vector = jnp.concatenate([jnp.ravel(x) for x in wide] or [jnp.zeros((0,))])
    if residual is not None:
        vector = vector + residual

    def full_width(vector: Any, q: Any) -> tuple[Any, Any, Any, Any]:
        out = _comm.reduce_all([vector, *others], op, comm=comm, check=False, what="gradient tree")
        return out[0], jnp.zeros_like(vector), list(out[1:]), q

    def power(vector: Any, q: Any) -> tuple[Any, Any, Any, Any]:
        return _power(vector, q, plan=plan, others=others, op=op, comm=comm, size=size)

    if psgd.start_step == 0:
        reduced, error, out, q = power(vector, state.q)
    else:
        reduced, error, out, q = jax.lax.cond(
            state.count >= psgd.start_step, power, full_width, vector, state.q
        )
    leaves, start = [], 0
    for x in wide:
        leaves.append(reduced[start : start + x.size].reshape(x.shape))
        start += x.size
    return leaves, error, out, q


def _power(
    vector: Any, q: Any, *, plan: _Plan, others: list[Any], op: ReduceOp, comm: Any, size: int
) -> tuple[Any, Any, Any, Any]:
    """PowerSGD's step: the reduced approximation, this rank's error, the exact leaves
    (``others``, reduced with the ``P`` factors) and the next ``Q``."""
    ms, start = [], 0
    for n, m, _ in plan.matrices:
        ms.append(vector[start : start + n * m].reshape(n, m))
        start += n * m
    ps = [mat @ qi for mat, qi in zip(ms, q, strict=True)]
    got = _comm.reduce_all([*ps, *others], op, comm=comm, check=False)
    ps, out = [_orthonormal(p) for p in got[: len(ps)]], list(got[len(ps) :])
    qs = [mat.T @ p for mat, p in zip(ms, ps, strict=True)]
    qs = _comm.reduce_all(qs, op, comm=comm, check=False)
    approx = [p @ qn.T for p, qn in zip(ps, qs, strict=True)]
    reduced = jnp.concatenate([a.ravel() for a in approx])
    scale = size if op == "sum" else 1
    error = vector - reduced / scale
    # a zero gradient gives a zero Q, from which no later P could grow: keep the old
    q = tuple(jnp.where(jnp.any(qn != 0), qn, qo) for qn, qo in zip(qs, q, strict=True))
    return reduced, error, out, q


def _check_state(
    state: Any, plan: _Plan, compression: Compression, error_feedback: bool, size: int
) -> None:
    if not isinstance(state, CompressionState):
        msg = (
            "Expected the state of `allreduce_gradients(compression=...)` to be the "
            f"CompressionState its `init` returned, got a {type(state).__name__} instead."
        )
        raise TypeError(msg)
    want = (plan.length,) if error_feedback and plan.length else None
    have = state.residual.inner[0].shape if isinstance(state.residual, ShardedState) else None
    slicing = state.residual.slicing if isinstance(state.residual, ShardedState) else None
    if have != want or (slicing is not None and slicing.size != size):
        msg = (
            "The state of `allreduce_gradients(compression=...)` was made for other "
            f"parameters or another world size (a residual of shape {have}, where these "
            f"gradients at {size} ranks need {want}). Call `tx.init(params)` with these "
            "parameters, at this world size."
        )
        raise ValueError(msg)
    if isinstance(compression, PowerSGD):
        shapes = [(m, r) for _, m, r in plan.matrices]
        if [tuple(np.shape(q)) for q in state.q] != shapes:
            msg = (
                "The state of `allreduce_gradients(compression=jaxddp.PowerSGD(...))` was "
                "made for other parameters or another rank: call `tx.init(params)` again."
            )
            raise ValueError(msg)
