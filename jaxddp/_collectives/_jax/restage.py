"""A jitted function whose collectives were staged for its own top level, called again
inside another trace (a jit, a loop body, a branch): its collectives are staged there afresh,
each through :func:`jaxddp._collectives._jax.chain.stage` as if first traced there (see
README.md of this folder).
"""

from __future__ import annotations

import functools
from typing import Any

from jax.extend.core import Literal, Var
from jax.extend.core.primitives import create_token_p

from . import compat
from .chain import close_chain, stage
from .compat import ordered_effect
from .forms import NESTED_MESSAGE, bridge_p, chained_p, ordered_p

__all__ = ["install"]


@functools.cache
def install() -> None:
    """Wraps JAX's staging rule for ``jit`` (once per process, on the fast path only)."""
    jax_rule = compat.jit_staging_rule()

    def staging_rule(trace: Any, source_info: Any, *args: Any, **params: Any) -> Any:
        closed = params["jaxpr"]
        if _replays(closed.jaxpr):
            return _replay(trace, source_info, closed, args)
        if ordered_effect() in closed.effects:  # its collectives follow the caller's
            close_chain(trace)
        return jax_rule(trace, source_info, *args, **params)

    compat.set_jit_staging_rule(staging_rule)


def _replays(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` holds collectives at its own level, besides tangents. The linear
    part JAX splits off a differentiated step, holding tangents only, stays a call:
    transposed as one, its collectives are ordered where they must be."""
    return any(
        (e.primitive in (chained_p, ordered_p) and not e.params["tangent"])
        or e.primitive is bridge_p
        for e in jaxpr.eqns
    )


def _replay(trace: Any, source_info: Any, closed: Any, args: Any) -> list[Any]:
    """``closed``'s equations staged into ``trace``, its collectives staged afresh there."""
    jaxpr = closed.jaxpr
    ours = (chained_p, ordered_p, bridge_p)
    # the old chain's tokens: its create_token's and each collective's, read only by ours
    chain = {
        v
        for e in jaxpr.eqns
        if e.primitive in ours
        for v in [*e.invars, *e.outvars]
        if isinstance(v, Var) and v.aval == compat.abstract_token()
    }
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        if eqn.primitive is create_token_p and eqn.outvars[0] in chain:
            env[eqn.outvars[0]] = None  # the replayed collectives join the caller's chain
            continue
        if eqn.primitive not in ours and any(isinstance(v, Var) and v in chain for v in eqn.invars):
            raise NotImplementedError(NESTED_MESSAGE)  # the old chain's token, read elsewhere
        with compat.replay_context(eqn):
            if eqn.primitive is bridge_p:  # the old chain ended here: the caller's ends too
                close_chain(trace)
                outs = []
            elif eqn.primitive in ours:  # a collective, without the old chain's token
                start = 1 if eqn.primitive is chained_p else 0
                ins = [read(v) for v in eqn.invars[start:]]
                avals = [v.aval for v in eqn.invars[start:]]
                outs = stage(trace, ins, avals, eqn.params)
                outs = [None, *outs] if eqn.primitive is chained_p else outs
            else:  # as jax.core.eval_jaxpr binds an equation, in the calling trace
                if ordered_effect() in eqn.effects:  # a branch or loop holding collectives
                    close_chain(trace)
                ins = [read(v) for v in eqn.invars]
                with compat.set_current_trace(trace):
                    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    outs = [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [trace.to_jaxpr_tracer(read(v), source_info) for v in jaxpr.outvars]
