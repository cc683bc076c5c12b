"""How jaxddp's collectives become XLA custom calls: one side-effecting call per buffer, to
the FFI target of its record (:mod:`.records`; jaxddp's own allreduce on CPU,
:mod:`jaxddp._native`), each taking the previous call's token."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.core import ShapedArray
from jax.interpreters import mlir

from ... import _native
from . import compat, order
from .records import RECORDS, Handle

__all__ = ["emit", "out_avals"]


# A maximum or minimum of floats travels as integers of the same width that order as the
# floats do (.order): MPI's MAX and MIN of floats keep a NaN or drop it depending on the MPI
# library and on which rank holds it; the keys keep it on every path (MPI, shared memory,
# either handler, the xla path), and give -0.0 < +0.0 on each.


def _ordered_as_keys(kind: str, params: dict[str, Any], aval: Any, target: str) -> bool | None:
    """For a maximum (True) or minimum (False) of floats: whether the largest key wins;
    None for any other call, and where jaxddp's handler reduces in shared memory (which
    compares the same keys itself: the conversions cost more there than the reduction)."""
    if kind not in ("allreduce", "reduce") or np.dtype(aval.dtype) not in order.KEY_TYPES:
        return None
    if _native.reduces_in_shared_memory(target, params["comm"].handle):
        return None
    from mpi4py import MPI

    op = params["op"]
    return True if op == Handle(MPI.MAX) else False if op == Handle(MPI.MIN) else None


def _target(kind: str, platforms: tuple[str, ...]) -> str:
    """The FFI target of a collective ``kind`` in a program lowered for ``platforms``: on a
    GPU, jaxddp's staged handlers where every rank agreed on them, else mpi4jax's (told to
    stage through host memory unless MPI takes GPU buffers); on CPU, jaxddp's allreduce
    where every rank agreed on it (the staged handlers where the test suite forces them),
    mpi4jax's for the other kinds (the narrow allreduce, jaxddp's alone, only on CPU)."""
    record = RECORDS[kind]
    if not record.staged and platforms != ("cpu",):  # bound only for a program for CPU
        msg = (
            f"jaxddp's {record.name} runs on CPU only, but a program for {platforms} holds it: "
            "compile the step for one platform (the one `jax.default_backend()` names)."
        )
        raise RuntimeError(msg)
    if platforms == ("cpu",):
        if _native.cpu_staged():
            return _native.gpu_target(kind) or record.target
        if record.native:
            return _native.cpu_target(kind) or record.target
        return record.target
    if platforms == ("cuda",) and (staged := _native.gpu_target(kind)) is not None:
        return staged
    if "cuda" in platforms:  # mpi4jax's CUDA handler: told how to treat GPU buffers
        if not compat.mpi4jax_has_cuda():
            msg = (
                f"jaxddp's {record.name} cannot run in a program for a GPU here: jaxddp's GPU "
                f"handlers are not in use ({_native.gpu_status()}) and mpi4jax has no CUDA "
                "extension. Turn JAXDDP_NATIVE_ALLREDUCE on and give jaxddp a C++ compiler "
                "(`CXX`; `jaxddp doctor` says why they are not in use), or build mpi4jax with "
                "CUDA (`CUDA_ROOT` set to the CUDA toolkit, see the docs' GPUs page)."
            )
            raise RuntimeError(msg)
        compat.mpi4jax_stages_through_host(not _native.gpu_buffers_to_mpi())
    return record.target


def _convert(ctx: Any, fn: Any, x: Any, aval_in: Any, aval_out: Any) -> Any:
    sub = ctx.replace(avals_in=(aval_in,), avals_out=(aval_out,))
    (out,) = mlir.lower_fun(fn, multiple_results=False)(sub, x)
    return out


def emit(
    ctx: Any, token: Any, xs: Sequence[Any], avals: tuple[Any, Any], *, kind: str, params: Any
) -> tuple[Any, list[Any]]:
    """One side-effecting custom call per buffer, each taking the previous call's token (for
    a kind of ``one_call``, one call of every buffer).

    jaxddp's own handler also gets each call's description (``params["calls"]``, where the
    caller gave them), which it compares across the ranks in shared memory."""

    record = RECORDS[kind]
    target = _target(kind, tuple(ctx.module_context.platforms))
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True)
    if record.one_call:  # every buffer in one call, the token last
        token_aval = compat.abstract_token()
        sub = ctx.replace(avals_in=(*avals[0], token_aval), avals_out=(*avals[1], token_aval))
        *outs, token = rule(sub, *xs, token, **record.call_attrs(params, avals[0][0]))
        return token, list(outs)
    calls = params.get("calls") or ("",) * len(xs)
    outs = []
    for x, aval_in, aval_out, call in zip(xs, *avals, calls, strict=True):
        largest = _ordered_as_keys(kind, params, aval_in, target)
        wire, wire_in, wire_out = x, aval_in, aval_out
        if largest is not None:
            wire_in = aval_in.update(dtype=order.KEY_TYPES[np.dtype(aval_in.dtype)])
            wire_out = aval_out.update(dtype=wire_in.dtype)
            wire = _convert(
                ctx, functools.partial(order.keys, largest=largest), x, aval_in, wire_in
            )
        token_aval = compat.abstract_token()
        sub = ctx.replace(avals_in=(wire_in, token_aval), avals_out=(wire_out, token_aval))
        attrs = record.call_attrs(params, wire_in)
        if target in (_native.TARGET, _native.gpu_target("allreduce")):
            attrs["call"] = call
        out, token = rule(sub, wire, token, **attrs)
        if largest is not None:
            back = functools.partial(order.floats, dtype=aval_out.dtype)
            out = _convert(ctx, back, out, wire_out, aval_out)
        outs.append(out)
    return token, outs


def out_avals(kind: str, avals: Sequence[Any], params: dict[str, Any]) -> list[ShapedArray]:
    """What the collective ``kind`` returns for buffers of ``avals``."""
    out_aval = RECORDS[kind].out_aval
    return [out_aval(a, params) for a in avals]
