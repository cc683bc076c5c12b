"""A jitted function whose collectives were chained for the top level, called again inside
another trace (a jit, a loop body, a branch): its collectives are staged there afresh.

JAX caches a jitted function's jaxpr and reuses it wherever the function is called. One
first traced on its own holds ``jaxddp_chained`` collectives, chained for its own top level;
inside another computation that chain would not be ordered with the caller's collectives.
jaxddp therefore wraps JAX's staging rule for ``jit``: a cached jaxpr holding such a chain
is not staged as a call but replayed, equation by equation, into the trace that calls it,
each collective through :func:`jaxddp._primitive._stage` as if first traced there (chained
at the caller's own level, ordered inside control flow), every other equation as it was,
as ``jax.jit(f, inline=True)`` inlines a function into its caller.

A branch or loop of the cached jaxpr whose ordered collectives continue the chain (a
collective inside control flow after chained ones) takes the caller's chain over in the
same way (:func:`jaxddp._primitive.hand_over_chain`), where the caller is a jit's own level
with its chain still open. Anywhere else its order against the caller's collectives cannot
be guaranteed, and staging it raises :data:`NESTED_MESSAGE`. The wrapper is installed the
first time a chain is staged (:func:`install`), so a program that never stages one runs
JAX's rule untouched.
"""

from __future__ import annotations

import functools
from typing import Any

from jax._src import source_info_util
from jax._src.core import Literal, Tracer, Var
from jax._src.interpreters import partial_eval as pe
from jax._src.lax.lax import create_token_p
from jax._src.pjit import jit_p

__all__ = ["install"]

NESTED_MESSAGE = (
    "A jitted function holding jaxddp collectives was first traced on its own, and is now "
    "called inside another computation (a loop, a branch, or a jit whose collectives are "
    "already ordered) where its collectives, chained for the top level, cannot be ordered "
    "with the caller's. This happens when its own collectives also sit inside a loop or "
    "branch (e.g. `optax.MultiSteps`). Call it only at the top level, and inside other "
    "jitted code call the Python function it wraps: traced there, its collectives are "
    "ordered with the caller's."
)


@functools.cache
def install() -> None:
    """Wraps JAX's staging rule for ``jit`` (once per process)."""
    jax_rule = pe.custom_staging_rules[jit_p]

    def staging_rule(trace: Any, source_info: Any, *args: Any, **params: Any) -> Any:
        closed = params["jaxpr"]
        if not _replays(closed, trace):
            return jax_rule(trace, source_info, *args, **params)
        return _replay(trace, source_info, closed, args)

    pe.custom_staging_rules[jit_p] = staging_rule


def _replays(closed: Any, trace: Any) -> bool:
    """Whether ``closed``, staged into ``trace``, is replayed there: it holds a chain of a
    function's own collectives, or it closes over a tracer. JAX never makes a call that
    closes over one, except where a collective staged while transposing a step took the
    chain's token from the jit being traced (the token continues that jit's chain); such a
    call could not be compiled, and replayed into that jit it continues the chain there.
    The linear part JAX splits off a differentiated step, holding tangents only, stays a
    call: transposed as one, its collectives are ordered where they must be.
    """
    from ._primitive import _chained_p

    if any(e.primitive is _chained_p and not e.params["tangent"] for e in closed.jaxpr.eqns):
        return True
    return any(isinstance(c, Tracer) and c._trace is trace for c in closed.consts)


def _reads_chain(eqn: Any, chain: set[Any]) -> list[Any]:
    """The old chain's tokens that ``eqn`` (not a chained collective) reads."""
    return [v for v in eqn.invars if isinstance(v, Var) and v in chain]


def _replay(trace: Any, source_info: Any, closed: Any, args: Any) -> list[Any]:
    """``closed``'s equations staged into ``trace``, its collectives staged afresh there."""
    from ._primitive import _chained_p, hand_over_chain, restage

    jaxpr = closed.jaxpr
    links = [e for e in jaxpr.eqns if e.primitive is _chained_p]
    chain = {e.invars[0] for e in links} | {e.outvars[0] for e in links}  # the old tokens
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        if eqn.primitive is create_token_p and eqn.outvars[0] in chain:
            env[eqn.outvars[0]] = None  # the replayed collectives join the caller's chain
            continue
        if eqn.primitive is not _chained_p and (taken := _reads_chain(eqn, chain)):
            # a branch or loop whose ordered collectives continue the chain: here it
            # continues the caller's, which switches to ordered collectives after it
            token = hand_over_chain(trace)
            if token is None:
                raise NotImplementedError(NESTED_MESSAGE)
            env.update(dict.fromkeys(taken, token))
        ins = [read(v) for v in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (
            source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
            eqn.ctx.manager,
        ):
            if eqn.primitive is _chained_p:  # the old token is dropped; the caller's is taken
                avals = [v.aval for v in eqn.invars[1:]]
                outs = [None, *restage(trace, ins[1:], avals, eqn.params)]
            else:
                avals = [v.aval for v in eqn.invars]
                outs = eqn.primitive.bind_with_trace(trace, ins, avals, eqn.params)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [trace.to_jaxpr_tracer(read(v), source_info) for v in jaxpr.outvars]
