"""How jaxddp's collectives become XLA custom calls: one side-effecting call per buffer, to
the FFI target of its record (:mod:`.records`; jaxddp's own allreduce on CPU,
:mod:`jaxddp._native`), each taking the previous call's token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.core import ShapedArray

from ... import _native
from . import compat
from .records import RECORDS

__all__ = ["emit", "out_avals"]


def emit(
    ctx: Any, token: Any, xs: Sequence[Any], avals: tuple[Any, Any], *, kind: str, params: Any
) -> tuple[Any, list[Any]]:
    """One side-effecting custom call per buffer, each taking the previous call's token."""

    record = RECORDS[kind]
    target = record.target
    if record.native and tuple(ctx.module_context.platforms) == ("cpu",):
        target = _native.allreduce_target() or target  # what every rank agreed on
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True)
    outs = []
    for x, aval_in, aval_out in zip(xs, *avals, strict=True):
        token_aval = compat.abstract_token()
        sub = ctx.replace(avals_in=(aval_in, token_aval), avals_out=(aval_out, token_aval))
        out, token = rule(sub, x, token, **record.call_attrs(params, aval_in))
        outs.append(out)
    return token, outs


def out_avals(kind: str, avals: Sequence[Any], params: dict[str, Any]) -> list[ShapedArray]:
    """What the collective ``kind`` returns for buffers of ``avals``."""
    out_aval = RECORDS[kind].out_aval
    return [out_aval(a, params) for a in avals]
