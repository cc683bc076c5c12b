"""jaxddp's MPI primitives: no JAX effect where the order is provable, so a jitted step
keeps JAX's C++ fast dispatch path.

An executable that holds a primitive with a JAX effect (mpi4jax's are ordered effects) is
dispatched on JAX's Python path, at microseconds per argument and result leaf. jaxddp's
collectives (:data:`allreduce_p`, :data:`bcast_p`, :data:`reduce_p`, :data:`allgather_p`,
:data:`alltoall_p`) are what JAX's
transformations see; where one is staged into a jaxpr (:func:`_stage`) it takes one of two
forms, both lowered to the FFI targets mpi4jax registers (``mpi_allreduce_ffi``, ...):

* ``jaxddp_chained``, at the jit's own level: no effect. It takes the XLA token of the
  collective staged before it in the same jit and returns its own, so its custom calls form
  one chain in XLA:CPU's execution graph (``tests/test_ordering.py`` reads that graph).
  Across executables, the PjRt CPU client runs a device's executables in dispatch order.
* ``jaxddp_ordered``, inside control flow and nested jits: mpi4jax's ordered effect, whose
  token JAX threads through ``cond``, loops and calls. Before the first one, a
  ``jaxddp_bridge`` at the jit's own level takes the last chained token into that effect
  token, and every later collective of that jit is ordered too, so the two forms make one
  chain. The nested trace never holds the chain's token itself, so no jaxpr JAX caches
  closes over a tracer of another trace.

A jitted function first traced on its own (its collectives chained for its own top level)
and then called inside another trace is replayed into it (:mod:`jaxddp._collectives._jax.restage`), so that
its collectives take the form they would have had if first traced there.

Where that ordering has not been established (another platform, a JAX outside
:data:`jaxddp._collectives._jax.compat.VERIFIED`, several local devices), :func:`fast_path` is False:
every collective binds the ordered form directly (slower to dispatch, as mpi4jax), and
nothing of JAX's own rules is changed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.extend.core.primitives import create_token_p
from jax.interpreters import ad, batching, mlir

from . import compat
from . import restage as _restage
from .compat import ordered_effect
from .lowering import Handle, emit, out_avals

__all__ = [
    "allgather_many",
    "allreduce_many",
    "alltoall_many",
    "bcast_many",
    "close_chain",
    "fast_path",
    "path_reason",
    "reduce_many",
    "restage",
]

# Test-suite switch between the two paths ("fast" or "ordered"); not a user setting.
PATH_VARIABLE = "JAXDDP_TEST_COLLECTIVE_PATH"


@functools.cache
def path_reason() -> tuple[bool, str]:
    """Whether jaxddp's collectives take the fast path, and why (decided once)."""
    forced = os.environ.get(PATH_VARIABLE, "").strip().lower()
    if forced in ("fast", "ordered"):
        fast, why = forced == "fast", f"{PATH_VARIABLE}={forced}"
    elif (reason := compat.unverified_reason() or compat.missing_internals()) is not None:
        fast, why = False, reason
    elif jax.default_backend() != "cpu":
        fast, why = False, f"the {jax.default_backend()} backend (the fast path is CPU's)"
    elif jax.local_device_count() != 1:
        fast, why = False, f"{jax.local_device_count()} local devices (the fast path needs one)"
    else:
        jax_version, _ = compat.jax_versions()
        fast, why = True, f"jax {jax_version} on CPU with one local device, verified"
    if fast:
        compat.keep_in_dce(_chained_p)  # a chained collective is never dead code
    return fast, why


def fast_path() -> bool:
    """Whether jaxddp's collectives use the effect-free primitives (decided once)."""
    return path_reason()[0]


# The two forms a collective takes once staged into a jaxpr. `chained`: no effect; it takes
# the token of the collective staged before it in the same jit and returns its own, so the
# custom calls form one chain in XLA:CPU's execution graph. `ordered`: mpi4jax's ordered
# effect, whose token JAX threads through control flow and across executables; a bridge
# (below) carries the last chained token into it.
_chained_p = Primitive("jaxddp_chained")
_chained_p.multiple_results = True
_chained_p.def_abstract_eval(
    lambda token, *xs, kind, tangent, **params: [
        compat.abstract_token(),
        *out_avals(kind, xs, params),
    ]
)


def _lower_chained(
    ctx: Any, token: Any, *xs: Any, kind: str, tangent: bool, **params: Any
) -> list[Any]:
    if not compat.lowering_into_main():
        # Chained collectives compiled below a main function (a branch or loop staged
        # outside any jit, or a body reused from such a trace): their chain would not be
        # ordered with the other collectives.
        msg = _restage.NESTED_MESSAGE
        raise NotImplementedError(msg)
    token, outs = emit(
        ctx, token, xs, (ctx.avals_in[1:], ctx.avals_out[1:]), kind=kind, params=params
    )
    return [token, *outs]


# Not cacheable: emitted in place, so that it can tell where it is emitted.
mlir.register_lowering(_chained_p, _lower_chained, platform="cpu", cacheable=False)

_ordered_p = Primitive("jaxddp_ordered")
_ordered_p.multiple_results = True


def _ordered_abstract(*xs: Any, kind: str, tangent: bool, **params: Any) -> Any:
    return out_avals(kind, xs, params), {ordered_effect()}


_ordered_p.def_effectful_abstract_eval(_ordered_abstract)
_ordered_p.def_impl(functools.partial(compat.apply_primitive, _ordered_p))


def _lower_ordered(ctx: Any, *xs: Any, kind: str, tangent: bool, **params: Any) -> list[Any]:
    token = ctx.tokens_in.get(ordered_effect())
    token, outs = emit(ctx, token, xs, (ctx.avals_in, ctx.avals_out), kind=kind, params=params)
    ctx.set_tokens_out(mlir.TokenSet({ordered_effect(): token}))
    return outs


# Where a jit's first collective below its own level is staged (inside control flow, a
# nested jit, a transposition), the jit's chain ends: `jaxddp_bridge`, staged at the jit's
# own level just before it, takes the chain's last token into mpi4jax's ordered effect,
# whose token every later collective of the jit follows. The nested trace never holds the
# chain's token, so no jaxpr that JAX caches closes over a tracer of another trace.
_bridge_p = Primitive("jaxddp_bridge")
_bridge_p.multiple_results = True


def _bridge_abstract(token: Any) -> Any:
    return [], {ordered_effect()}


_bridge_p.def_effectful_abstract_eval(_bridge_abstract)


def _lower_bridge(ctx: Any, token: Any) -> list[Any]:
    effect = ctx.tokens_in.get(ordered_effect())
    ctx.set_tokens_out(mlir.TokenSet({ordered_effect(): compat.after_all([token, effect])}))
    return []


mlir.register_lowering(_bridge_p, _lower_bridge, platform="cpu")
ad.primitive_jvps[_bridge_p] = lambda primals, tangents: (_bridge_p.bind(*primals), [])
batching.primitive_batchers[_bridge_p] = lambda args, dims: (_bridge_p.bind(*args), [])


# A tangent's collective transposes to the sum of the cotangents, as `jax.lax.psum` does.
def _transpose_tangent(p: Primitive, cts: Any, *args: Any, tangent: bool, **params: Any) -> Any:
    if not tangent:
        msg = "Only the tangent of jaxddp's allreduce can be transposed."
        raise NotImplementedError(msg)
    if p is _ordered_p:
        return _sum_cotangents(cts, params["comm"])
    return [None, *_sum_cotangents(cts[1:], params["comm"])]  # the token's is dropped


ad.primitive_transposes[_ordered_p] = functools.partial(_transpose_tangent, _ordered_p)
ad.primitive_transposes[_chained_p] = functools.partial(_transpose_tangent, _chained_p)


# Transformations of a jaxpr that is already staged (a cached jit called under grad or
# vmap) see the staged forms: they differentiate and batch like the allreduce they came from.
def _staged_jvp(p: Primitive, primals: Any, tangents: Any, **params: Any) -> Any:
    if params["kind"] != "allreduce":
        _no_derivative(params["kind"])(primals, tangents)
    # a chained form takes a token and returns one; an ordered form has none (its token is
    # JAX's effect token)
    token = 1 if p is _chained_p else 0
    outs = p.bind(*primals, **params)
    tangent_outs = _reduce_tangents(
        primals[token:], outs[token:], tangents[token:], op=params["op"], comm=params["comm"]
    )
    lead = [ad.Zero(o.aval.to_tangent_aval()) for o in outs[:token]]
    return outs, [*lead, *tangent_outs]


def _staged_batcher(p: Primitive, args: Any, dims: Any, **params: Any) -> Any:
    if params["kind"] != "allreduce":
        msg = f"jaxddp's {params['kind']} cannot be batched with vmap."
        raise NotImplementedError(msg)
    if p is _ordered_p:
        return p.bind(*args, **params), list(dims)
    return p.bind(*args, **params), [None, *dims[1:]]  # the token is not batched


for _staged in (_chained_p, _ordered_p):
    ad.primitive_jvps[_staged] = functools.partial(_staged_jvp, _staged)
    batching.primitive_batchers[_staged] = functools.partial(_staged_batcher, _staged)


for _platform in ("cpu", "cuda", "rocm"):
    with contextlib.suppress(NotImplementedError):  # a platform whose plugin is absent
        mlir.register_lowering(_ordered_p, _lower_ordered, platform=_platform)


class _Chain:
    """What one jit's trace has staged: the last chained token, and whether a collective
    inside control flow (or a nested jit) has switched the rest to the ordered form."""

    __slots__ = ("switched", "token")

    def __init__(self) -> None:
        self.token: Any = None
        self.switched = False


_chains: weakref.WeakKeyDictionary[Any, _Chain] = weakref.WeakKeyDictionary()


def _chain_of(trace: Any) -> tuple[Any, _Chain]:
    """The jit that ``trace`` belongs to (its outermost jaxpr trace), and its chain."""
    root = compat.outermost_jaxpr_trace(trace)
    chain = _chains.get(root)
    if chain is None:
        chain = _chains.setdefault(root, _Chain())
    return root, chain


def _stage(p: _Collective, trace: Any, args: Sequence[Any], avals: Any, params: Any) -> list[Any]:
    """Stages a collective into ``trace``: chained at the jit's own level, ordered inside
    control flow and nested jits (and everywhere when the fast path is off).

    The first collective staged below the jit's own level ends the chain (:func:`close_chain`):
    a bridge at the jit's own level continues it into JAX's effect token, and every later
    collective in the jit is ordered too.
    A tangent (a differentiated collective) staged at the jit's own level, as forward mode
    does, joins the chain; one staged deeper (reverse mode's linearized trace, which
    transposes it away) is ordered and leaves the chain alone.
    """
    params = dict(params, kind=p.kind)
    root, chain = _chain_of(trace)
    if fast_path():
        _restage.install()  # a jaxpr staged now, if later called inside another jit, is replayed
    if fast_path() and trace is root and not chain.switched:
        token = chain.token
        if token is None:
            _wait_at_exit()
            token = create_token_p.bind_with_trace(root, (), (), {})
        token, *outs = _chained_p.bind_with_trace(
            trace,
            (token, *args),
            (compat.abstract_token(), *avals),
            dict(params, tangent=p.tangent),
        )
        chain.token = token
        return outs
    if not p.tangent:
        close_chain(trace)
    params.update(tangent=p.tangent)
    return _ordered_p.bind_with_trace(trace, tuple(args), tuple(avals), params)


def close_chain(trace: Any) -> None:
    """Ends the chain of the jit that ``trace`` belongs to: a bridge from its last token
    into mpi4jax's ordered effect (:data:`_bridge_p`), staged at the jit's own level, and
    every later collective of that jit ordered."""
    root, chain = _chain_of(trace)
    if chain.switched:
        return
    chain.switched = True
    if chain.token is not None:
        _bridge_p.bind_with_trace(root, (chain.token,), (compat.abstract_token(),), {})
        chain.token = None


@functools.cache
def _wait_at_exit() -> None:
    """At exit, waits for every dispatched executable before MPI is finalized.

    JAX's effects barrier does not wait for executables without effects. Today the backend's
    own teardown at exit waits for its thread pool anyway (the exit-without-waiting test
    passes without this); this makes the guarantee jaxddp's own. The PjRt CPU client runs
    a device's executables in dispatch order, so a trivial one dispatched last is done only
    when all before it are; mpi4py finalizes MPI after every Python ``atexit`` handler.
    """
    import atexit

    def wait() -> None:
        with contextlib.suppress(Exception):  # the runtime may already be shutting down
            jax.block_until_ready(jax.numpy.zeros(()) + 1)

    atexit.register(wait)


class _Collective(Primitive):
    """A collective as JAX transforms see it (differentiation, vmap); the form it takes in
    the compiled program is decided where it is staged into a jaxpr (:func:`_stage`)."""

    multiple_results = True

    def __init__(self, kind: str, *, tangent: bool = False) -> None:
        super().__init__(f"jaxddp_{kind}{'_tangent' if tangent else ''}")
        self.kind = kind
        self.tangent = tangent

    def bind(self, *args: Any, **params: Any) -> Any:
        if not fast_path():  # the ordered form, bound as any primitive: nothing of JAX changes
            return _ordered_p.bind(*args, **params, kind=self.kind, tangent=self.tangent)
        return super().bind(*args, **params)

    def bind_with_trace(self, trace: Any, args: Any, avals: Any, params: Any, /) -> Any:
        # reached on the fast path only (see bind)
        if compat.is_jaxpr_trace(trace):
            return _stage(self, trace, args, avals, params)
        return super().bind_with_trace(trace, args, avals, params)


def _collective(kind: str, *, tangent: bool = False) -> _Collective:
    p = _Collective(kind, tangent=tangent)
    p.def_impl(functools.partial(compat.apply_primitive, p))
    p.def_abstract_eval(lambda *xs, **params: out_avals(kind, xs, params))
    return p


allreduce_p = _collective("allreduce")
bcast_p = _collective("bcast")
reduce_p = _collective("reduce")
# Moves only (for the sharded optimizer): an allgather stacks every rank's buffer on a new
# first axis; an alltoall sends row j of a (size, ...) buffer to rank j.
allgather_p = _collective("allgather")
alltoall_p = _collective("alltoall")
# The tangent of a sum: a sum of the tangents, whose transpose sums the cotangents, as
# `jax.lax.psum`'s does. Every rank computes the same loss from every rank's values, so the
# gradient with respect to one rank's inputs gathers every rank's cotangent: a loss built
# with `masked_mean`, then `allreduce_gradients()` (a mean), gives the 1-process gradient.
_tangent_p = _collective("allreduce", tangent=True)


_COLLECTIVES = {
    (p.kind, p.tangent): p
    for p in (allreduce_p, bcast_p, reduce_p, allgather_p, alltoall_p, _tangent_p)
}


def restage(trace: Any, args: Sequence[Any], avals: Any, params: dict[str, Any]) -> list[Any]:
    """A collective of a cached jaxpr (its ``params``; its inputs without a chain token),
    staged afresh into ``trace`` (see :mod:`jaxddp._collectives._jax.restage`)."""
    params = dict(params)
    p = _COLLECTIVES[params.pop("kind"), params.pop("tangent")]
    return _stage(p, trace, args, avals, params)


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
        reduced = _tangent_p.bind(*ts, op=op, comm=comm)
    elif op in (Handle(MPI.MAX), Handle(MPI.MIN)):
        chosen = [primals[i] == outs[i] for i in live]
        counts = allreduce_p.bind(
            *[c.astype(t.dtype) for c, t in zip(chosen, ts, strict=True)],
            op=Handle(MPI.SUM),
            comm=comm,
        )
        picked = [jax.numpy.where(c, t, 0) for c, t in zip(chosen, ts, strict=True)]
        summed = _tangent_p.bind(*picked, op=Handle(MPI.SUM), comm=comm)
        reduced = [s / n for s, n in zip(summed, counts, strict=True)]
    else:  # pragma: no cover - jaxddp binds no other op
        msg = f"jaxddp's allreduce has no derivative for the MPI op {op!r}."
        raise NotImplementedError(msg)
    for i, t in zip(live, reduced, strict=True):
        result[i] = t
    return result


def _allreduce_jvp(primals: Any, tangents: Any, *, op: Handle, comm: Handle) -> Any:
    outs = allreduce_p.bind(*primals, op=op, comm=comm)
    return outs, _reduce_tangents(primals, outs, tangents, op=op, comm=comm)


def _no_derivative(kind: str) -> Any:
    def rule(primals: Any, tangents: Any, **params: Any) -> Any:
        msg = (
            f"jaxddp's {kind} has no derivative; only allreduce does. Wrap its input in "
            "`jax.lax.stop_gradient` if only its value is needed."
        )
        raise NotImplementedError(msg)

    return rule


ad.primitive_jvps[allreduce_p] = _allreduce_jvp
ad.primitive_jvps[bcast_p] = _no_derivative("broadcast")
ad.primitive_jvps[reduce_p] = _no_derivative("reduce")
ad.primitive_jvps[allgather_p] = _no_derivative("allgather")
ad.primitive_jvps[alltoall_p] = _no_derivative("alltoall")
ad.primitive_jvps[_tangent_p] = lambda primals, tangents, **params: (
    _tangent_p.bind(*primals, **params),
    _tangent_p.bind(*[ad.instantiate_zeros(t) for t in tangents], **params),
)
ad.primitive_transposes[_tangent_p] = lambda cts, *xs, op, comm: _sum_cotangents(cts, comm)


def _elementwise_batcher(p: Primitive) -> Any:
    def rule(args: Any, dims: Any, **params: Any) -> Any:
        return p.bind(*args, **params), list(dims)

    return rule


for _p in (allreduce_p, _tangent_p):
    batching.primitive_batchers[_p] = _elementwise_batcher(_p)


def _after(xs: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
    """``xs``, made to depend on ``outs`` so that no rank's dead-code elimination drops the
    collective that made ``outs`` (a root's broadcast, a non-root's reduce), even inside a
    nested ``jit`` whose outputs would otherwise be its forwarded inputs."""
    return list(jax.lax.optimization_barrier((list(xs), list(outs)))[0])


def _register_targets() -> None:
    """Imports mpi4jax, whose import registers the FFI targets jaxddp's lowerings call."""
    import mpi4jax  # noqa: F401


def allreduce_many(xs: Sequence[Any], op: Any, comm: Any) -> list[Any]:
    """Allreduces each array of ``xs`` (dtypes MPI knows) with the MPI op ``op``."""
    if not xs:
        return []
    _register_targets()
    return allreduce_p.bind(*xs, op=Handle(op), comm=Handle(comm))


def bcast_many(xs: Sequence[Any], root: int, comm: Any) -> list[Any]:
    """Gives every rank ``root``'s values of each array of ``xs``."""
    if not xs:
        return []
    _register_targets()
    is_root = comm.Get_rank() == root
    out = bcast_p.bind(*xs, root=root, comm=Handle(comm), is_root=is_root)
    return _after(xs, out) if is_root else out


def reduce_many(xs: Sequence[Any], op: Any, root: int, comm: Any) -> list[Any]:
    """Reduces each array of ``xs`` onto ``root``; the other ranks get their input back."""
    if not xs:
        return []
    _register_targets()
    is_root = comm.Get_rank() == root
    out = reduce_p.bind(*xs, op=Handle(op), root=root, comm=Handle(comm), is_root=is_root)
    return out if is_root else _after(xs, out)


def allgather_many(xs: Sequence[Any], comm: Any) -> list[Any]:
    """Every rank's values of each array of ``xs``, stacked on a new first axis in rank
    order: ``(size, *x.shape)``."""
    if not xs:
        return []
    _register_targets()
    return allgather_p.bind(*xs, comm=Handle(comm), size=comm.Get_size())


def alltoall_many(xs: Sequence[Any], comm: Any) -> list[Any]:
    """Each array of ``xs`` has the communicator's size as its first axis; row ``j`` goes
    to rank ``j``, and row ``i`` of the result came from rank ``i``."""
    if not xs:
        return []
    size = comm.Get_size()
    for x in xs:
        if x.ndim == 0 or x.shape[0] != size:
            msg = f"Expected alltoall buffers of shape ({size}, ...), got {x.shape} instead."
            raise ValueError(msg)
    _register_targets()
    return alltoall_p.bind(*xs, comm=Handle(comm), size=size)
