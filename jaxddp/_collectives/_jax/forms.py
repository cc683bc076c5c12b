"""The two forms a collective takes once staged into a jaxpr, and the bridge between them.

``jaxddp_chained`` (no effect) takes the XLA token of the collective staged before it in the
same jit and returns its own; ``jaxddp_ordered`` carries mpi4jax's ordered effect, whose
token JAX threads through control flow; ``jaxddp_bridge`` carries the last chained token into
that effect. Both forms lower to the same custom calls (:mod:`.lowering`). Why there are two
forms, and where each is staged: the README of this folder.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import compat
from .compat import ordered_effect
from .lowering import emit, out_avals

__all__ = ["NESTED_MESSAGE", "bridge_p", "chained_p", "ordered_p"]

NESTED_MESSAGE = (
    "jaxddp collectives staged for a jit's own level are being compiled inside a branch or "
    "loop, where their order against the other collectives cannot be guaranteed. This "
    "happens with a `lax.cond`, `lax.scan` or loop holding jaxddp collectives outside any "
    "`jax.jit` (wrap the computation in `jax.jit`), or with a branch or loop body function "
    "first traced outside any jit and reused inside one (inside jitted code, use a function "
    "defined there)."
)


# The two forms a collective takes once staged into a jaxpr. `chained`: no effect; it takes
# the token of the collective staged before it in the same jit and returns its own, so the
# custom calls form one chain in XLA:CPU's execution graph. `ordered`: mpi4jax's ordered
# effect, whose token JAX threads through control flow and across executables; a bridge
# (below) carries the last chained token into it.
chained_p = Primitive("jaxddp_chained")
chained_p.multiple_results = True
chained_p.def_abstract_eval(
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
        msg = NESTED_MESSAGE
        raise NotImplementedError(msg)
    token, outs = emit(
        ctx, token, xs, (ctx.avals_in[1:], ctx.avals_out[1:]), kind=kind, params=params
    )
    return [token, *outs]


# Not cacheable: emitted in place, so that it can tell where it is emitted.
mlir.register_lowering(chained_p, _lower_chained, platform="cpu", cacheable=False)

ordered_p = Primitive("jaxddp_ordered")
ordered_p.multiple_results = True


def _ordered_abstract(*xs: Any, kind: str, tangent: bool, **params: Any) -> Any:
    return out_avals(kind, xs, params), {ordered_effect()}


ordered_p.def_effectful_abstract_eval(_ordered_abstract)
ordered_p.def_impl(functools.partial(compat.apply_primitive, ordered_p))


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
bridge_p = Primitive("jaxddp_bridge")
bridge_p.multiple_results = True


def _bridge_abstract(token: Any) -> Any:
    return [], {ordered_effect()}


bridge_p.def_effectful_abstract_eval(_bridge_abstract)


def _lower_bridge(ctx: Any, token: Any) -> list[Any]:
    effect = ctx.tokens_in.get(ordered_effect())
    ctx.set_tokens_out(mlir.TokenSet({ordered_effect(): compat.after_all([token, effect])}))
    return []


mlir.register_lowering(bridge_p, _lower_bridge, platform="cpu")
ad.primitive_jvps[bridge_p] = lambda primals, tangents: (bridge_p.bind(*primals), [])
batching.primitive_batchers[bridge_p] = lambda args, dims: (bridge_p.bind(*args), [])


for _platform in ("cpu", "cuda", "rocm"):
    with contextlib.suppress(NotImplementedError):  # a platform whose plugin is absent
        mlir.register_lowering(ordered_p, _lower_ordered, platform=_platform)
