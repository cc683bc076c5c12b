"""Which results of a step every rank computes alike: read from the step's own program.

The step runs under ``jax.shard_map`` with ``check_vma=False``, so that it differentiates as
it does per rank on the MPI path (with JAX's varying-axes typing on, a gradient with respect
to a replicated parameter would come out already summed over the ranks, and
``allreduce_gradients`` would sum it again). Which results are replicated is then found here,
on the jaxpr of the step: a value varies over the ranks where it depends on an argument that
enters as a per-rank block, on a constant that differs between the ranks, or on something that
is per-rank by nature (``axis_index``, an ``all_to_all``, a host callback); a reduction over
the ranks (``psum``, ``pmax``, ``pmin``, ``all_gather``) makes every rank's result the same.
Calls of other jaxprs (a nested ``jit``, ``remat``, custom derivatives) are followed; any
other construct with a jaxpr inside (a loop, a branch) varies where any of its inputs does or
where its body holds something per-rank. Wrong answers can only go one way: a result marked
per-rank that is in fact the same everywhere costs a little time, never a wrong value.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["varying_outputs"]

# a reduction over the named axes: the same result on every rank of them
_REDUCTIONS = frozenset({"psum", "pmax", "pmin", "all_gather", "psum_invariant", "pmean"})
# per-rank by nature
_SOURCES = frozenset(
    {
        "axis_index",
        "all_to_all",
        "ppermute",
        "psum_scatter",
        "reduce_scatter",
        "pbroadcast",
        "pure_callback",
        "io_callback",
        "debug_callback",
        "callback",
    }
)
# calls whose jaxpr takes the equation's inputs and gives its outputs, one for one
_CALLS = frozenset(
    {
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "remat",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "custom_lin",
    }
)


def _axes(params: dict[str, Any]) -> tuple[Any, ...]:
    names = params.get("axes", params.get("axis_name", ()))
    return tuple(names) if isinstance(names, tuple | list) else (names,)


def _jaxprs(params: dict[str, Any]) -> Iterator[Any]:
    """The open jaxprs among an equation's parameters (a closed one's inner jaxpr)."""
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(v, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                yield inner
            elif hasattr(v, "eqns") and hasattr(v, "invars"):
                yield v


def _has_source(jaxpr: Any, axis: str) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _SOURCES:
            return True
        if any(_has_source(sub, axis) for sub in _jaxprs(eqn.params)):
            return True
    return False


def _single(eqn: Any) -> Any:
    subs = list(_jaxprs(eqn.params))
    if eqn.primitive.name in _CALLS and len(subs) >= 1:
        sub = subs[0]
        if len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars):
            return sub
    return None


def varying_outputs(
    jaxpr: Any, inputs: Sequence[bool], consts: Sequence[bool], axis: str
) -> list[bool]:
    """For each output of ``jaxpr``, whether it may differ between the ranks of ``axis``,
    given whether each input and each constant may."""
    env: dict[Any, bool] = {}
    for var, varies in zip(jaxpr.constvars, consts, strict=True):
        env[var] = varies
    for var, varies in zip(jaxpr.invars, inputs, strict=True):
        env[var] = varies

    def read(atom: Any) -> bool:
        return env.get(atom, False) if hasattr(atom, "aval") and not hasattr(atom, "val") else False

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        name = eqn.primitive.name
        if name in _REDUCTIONS and axis in _axes(eqn.params):
            outs = [False] * len(eqn.outvars)
        elif name in _SOURCES:
            outs = [True] * len(eqn.outvars)
        elif (sub := _single(eqn)) is not None:
            outs = varying_outputs(sub, ins, [False] * len(sub.constvars), axis)
        else:
            subs = list(_jaxprs(eqn.params))
            varies = any(ins) or any(_has_source(s, axis) for s in subs)
            outs = [varies] * len(eqn.outvars)
        for var, varies in zip(eqn.outvars, outs, strict=True):
            env[var] = varies
    return [read(v) for v in jaxpr.outvars]
