"""jaxddp's collectives as JAX's transformations see them: no JAX effect where the order
is provable, so a jitted step keeps JAX's C++ fast dispatch path (the forms they take once
staged, and why: README.md of this folder), with their jvp, transpose and batching rules.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from . import compat, restage
from .chain import stage
from .forms import chained_p, ordered_p
from .lowering import out_avals
from .path import fast_path
from .records import RECORDS, Handle

__all__ = [
    "COLLECTIVES",
    "allgather_p",
    "allreduce_p",
    "alltoall_p",
    "bcast_p",
    "reduce_p",
    "tangent_p",
]


class Collective(Primitive):
    """A collective as JAX transforms see it (differentiation, vmap); the form it takes in
    the compiled program is decided where it is staged into a jaxpr
    (:func:`jaxddp._collectives._jax.chain.stage`)."""

    multiple_results = True

    def __init__(self, kind: str, *, tangent: bool = False) -> None:
        super().__init__(f"jaxddp_{kind}{'_tangent' if tangent else ''}")
        self.kind = kind
        self.tangent = tangent

    def bind(self, *args: Any, **params: Any) -> Any:
        if not fast_path():  # the ordered form, bound as any primitive: nothing of JAX changes
            return ordered_p.bind(*args, **params, kind=self.kind, tangent=self.tangent)
        return super().bind(*args, **params)

    def bind_with_trace(self, trace: Any, args: Any, avals: Any, params: Any, /) -> Any:
        # reached on the fast path only (see bind)
        if compat.is_jaxpr_trace(trace):
            restage.install()  # a jaxpr staged now, if later called inside another jit, is replayed
            return stage(trace, args, avals, dict(params, kind=self.kind, tangent=self.tangent))
        return super().bind_with_trace(trace, args, avals, params)


def collective(kind: str, *, tangent: bool = False) -> Collective:
    p = Collective(kind, tangent=tangent)
    p.def_impl(functools.partial(compat.apply_primitive, p))
    p.def_abstract_eval(lambda *xs, **params: out_avals(kind, xs, params))
    return p


# One primitive per record (records.py), its rules registered from the record below.
COLLECTIVES = {kind: collective(kind) for kind in RECORDS}
allreduce_p = COLLECTIVES["allreduce"]
bcast_p = COLLECTIVES["bcast"]
reduce_p = COLLECTIVES["reduce"]
allgather_p = COLLECTIVES["allgather"]
alltoall_p = COLLECTIVES["alltoall"]
# The tangent of a sum: a sum of the tangents, whose transpose sums the cotangents, as
# `jax.lax.psum`'s does. Every rank computes the same loss from every rank's values, so the
# gradient with respect to one rank's inputs gathers every rank's cotangent: a loss built
# with `masked_mean`, then `allreduce_gradients()` (a mean), gives the 1-process gradient.
tangent_p = collective("allreduce", tangent=True)


# A tangent's collective transposes to the sum of the cotangents, as `jax.lax.psum` does.
def _transpose_tangent(p: Primitive, cts: Any, *args: Any, tangent: bool, **params: Any) -> Any:
    if not tangent:
        msg = "Only the tangent of jaxddp's allreduce can be transposed."
        raise NotImplementedError(msg)
    if p is ordered_p:
        return _sum_cotangents(cts, params["comm"])
    return [None, *_sum_cotangents(cts[1:], params["comm"])]  # the token's is dropped


ad.primitive_transposes[ordered_p] = functools.partial(_transpose_tangent, ordered_p)
ad.primitive_transposes[chained_p] = functools.partial(_transpose_tangent, chained_p)


# Transformations of a jaxpr that is already staged (a cached jit called under grad or
# vmap) see the staged forms: they differentiate and batch like the allreduce they came from.
def _staged_jvp(p: Primitive, primals: Any, tangents: Any, **params: Any) -> Any:
    if not RECORDS[params["kind"]].differentiable:
        _no_derivative(params["kind"])(primals, tangents)
    # a chained form takes a token and returns one; an ordered form has none (its token is
    # JAX's effect token)
    token = 1 if p is chained_p else 0
    outs = p.bind(*primals, **params)
    tangent_outs = _reduce_tangents(
        primals[token:], outs[token:], tangents[token:], op=params["op"], comm=params["comm"]
    )
    lead = [ad.Zero(o.aval.to_tangent_aval()) for o in outs[:token]]
    return outs, [*lead, *tangent_outs]


def _staged_batcher(p: Primitive, args: Any, dims: Any, **params: Any) -> Any:
    if not RECORDS[params["kind"]].batchable:
        msg = f"jaxddp's {params['kind']} cannot be batched with vmap."
        raise NotImplementedError(msg)
    if p is ordered_p:
        return p.bind(*args, **params), list(dims)
    return p.bind(*args, **params), [None, *dims[1:]]  # the token is not batched


for _staged in (chained_p, ordered_p):
    ad.primitive_jvps[_staged] = functools.partial(_staged_jvp, _staged)
    batching.primitive_batchers[_staged] = functools.partial(_staged_batcher, _staged)


def _sum_cotangents(cts: Sequence[Any], comm: Handle) -> list[Any]:
    from mpi4py import MPI

    cts = [ad.instantiate_zeros(ct) for ct in cts]
    return allreduce_p.bind(*cts, op=Handle(MPI.SUM), comm=comm)


def _reduce_tangents(
    primals: Sequence[Any],
    outs: Sequence[Any],
    tangents: Sequence[Any],
    *,
    op: Handle,
    comm: Handle,
) -> list[Any]:
    """The tangents of an allreduce whose inputs are ``primals`` and results ``outs``.

    A sum's tangent is the sum of the tangents. A max's (or min's) is the tangent of the
    rank holding the extreme, shared equally among ranks that tie, as ``jnp.max`` does
    among the entries of one array.
    """
    from mpi4py import MPI

    # Only inexact buffers have tangents to reduce; the others' are float0 zeros.
    live = [i for i, x in enumerate(primals) if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)]
    result: list[Any] = [ad.Zero(jax.typeof(y).to_tangent_aval()) for y in outs]
    if not live or all(type(tangents[i]) is ad.Zero for i in live):
        return result
    ts = [ad.instantiate_zeros(tangents[i]) for i in live]
    if op == Handle(MPI.SUM):
        reduced = tangent_p.bind(*ts, op=op, comm=comm)
    elif op in (Handle(MPI.MAX), Handle(MPI.MIN)):
        chosen = [primals[i] == outs[i] for i in live]
        counts = allreduce_p.bind(
            *[c.astype(t.dtype) for c, t in zip(chosen, ts, strict=True)],
            op=Handle(MPI.SUM),
            comm=comm,
        )
        picked = [jax.numpy.where(c, t, 0) for c, t in zip(chosen, ts, strict=True)]
        summed = tangent_p.bind(*picked, op=Handle(MPI.SUM), comm=comm)
        reduced = [s / n for s, n in zip(summed, counts, strict=True)]
    else:  # pragma: no cover - jaxddp binds no other op
        msg = f"jaxddp's allreduce has no derivative for the MPI op {op!r}."
        raise NotImplementedError(msg)
    for i, t in zip(live, reduced, strict=True):
        result[i] = t
    return result


def _allreduce_jvp(primals: Any, tangents: Any, *, op: Handle, comm: Handle, **calls: Any) -> Any:
    outs = allreduce_p.bind(*primals, op=op, comm=comm, **calls)
    return outs, _reduce_tangents(primals, outs, tangents, op=op, comm=comm)


def _no_derivative(kind: str) -> Any:
    def rule(primals: Any, tangents: Any, **params: Any) -> Any:
        msg = (
            f"jaxddp's {kind} has no derivative; only allreduce does. Wrap its input in "
            "`jax.lax.stop_gradient` if only its value is needed."
        )
        raise NotImplementedError(msg)

    return rule


for _kind, _p in COLLECTIVES.items():  # the one place a record's rules are registered
    _record = RECORDS[_kind]
    ad.primitive_jvps[_p] = (
        _allreduce_jvp if _record.differentiable else _no_derivative(_record.name)
    )
ad.primitive_jvps[tangent_p] = lambda primals, tangents, **params: (
    tangent_p.bind(*primals, **params),
    tangent_p.bind(*[ad.instantiate_zeros(t) for t in tangents], **params),
)
ad.primitive_transposes[tangent_p] = lambda cts, *xs, op, comm: _sum_cotangents(cts, comm)


def _elementwise_batcher(p: Primitive) -> Any:
    def rule(args: Any, dims: Any, **params: Any) -> Any:
        return p.bind(*args, **params), list(dims)

    return rule


for _p in (*(p for kind, p in COLLECTIVES.items() if RECORDS[kind].batchable), tangent_p):
    batching.primitive_batchers[_p] = _elementwise_batcher(_p)
