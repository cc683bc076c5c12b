"""Which inner optimizers :func:`jaxddp.shard_optimizer` can run on a slice.

A slice of the packed gradient is exact for an element-wise optimizer: each element's
update depends on that element alone. One that computes across elements (a global norm, a
trust ratio per leaf, a factored second moment) would compute it over the rank's slice only,
and one that holds per-leaf masks would apply them to leaves the packed slice no longer has.
``init`` traces ``inner.update`` once on abstract slices and refuses both kinds, naming the
operation and where in the optimizer it was staged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from ..._collectives._jax import compat as _jax_compat
from ..compression import CompressionState

__all__ = ["check_elementwise"]

# Operations that combine elements of an array: over a gradient slice, a wrong answer.
REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "reduce", "argmax", "argmin", "dot_general", "cumsum", "cumprod", "cummax",
    "cummin", "cumlogsumexp", "sort", "top_k",
})  # fmt: skip

# JAX's collectives; jaxddp's own are the primitives named `jaxddp_*`.
_JAX_COLLECTIVES = frozenset({
    "psum", "pmax", "pmin", "all_to_all", "all_gather", "psum_scatter", "reduce_scatter",
    "ppermute", "all_gather_invariant",
})  # fmt: skip

# States whose transform applies per-leaf masks or labels.
_MASKED = tuple(
    t for t in (getattr(optax, n, None) for n in ("MaskedState", "MultiTransformState")) if t
)

# A slice length no real optimizer special-cases, so that an element-wise one shows no
# reduction over more than one element.
_PROBE = 7

_UNSHARDED = "Use `optax.chain(jaxddp.allreduce_gradients(), inner)` for it."
_FIX = (
    " Clip by the global norm with `jaxddp.shard_optimizer(inner, clip_global_norm=...)` "
    "(exact), or keep the full state with `optax.chain(jaxddp.allreduce_gradients(), inner)`."
)


def _sub_jaxprs(value: Any) -> list[Any]:
    """The jaxprs an equation's parameter holds (a loop's body, a branch, a nested jit)."""
    if hasattr(value, "eqns"):  # a Jaxpr
        return [value]
    if hasattr(value, "jaxpr") and hasattr(value, "consts"):  # a ClosedJaxpr
        return [value.jaxpr]
    if isinstance(value, tuple | list):
        return [j for v in value for j in _sub_jaxprs(v)]
    return []


def _first(jaxpr: Any, matches: Callable[[Any], bool]) -> Any:
    """The first equation ``matches`` accepts, in ``jaxpr`` or the jaxprs its equations hold."""
    for eqn in jaxpr.eqns:
        if matches(eqn):
            return eqn
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                found = _first(sub, matches)
                if found is not None:
                    return found
    return None


def _is_reduction(eqn: Any) -> bool:
    return eqn.primitive.name in REDUCTIONS and any(
        getattr(v.aval, "size", 1) > 1 for v in eqn.invars if hasattr(v, "aval")
    )


def _is_collective(eqn: Any) -> bool:
    name = eqn.primitive.name
    return name.startswith("jaxddp_") or name in _JAX_COLLECTIVES


def check_elementwise(inner: Any, mine: tuple[Any, ...], *, clip: float | None) -> None:
    """Raises ValueError where ``inner`` is not element-wise over the packed slices."""
    del clip  # clipping by the global norm runs before `inner`, on the whole gradient
    probe = tuple(jax.ShapeDtypeStruct((_PROBE,), x.dtype) for x in mine)
    failures = (ValueError, TypeError, KeyError)  # a per-leaf tree meets the slices
    try:
        state = jax.eval_shape(inner.init, probe)
    except failures as exc:
        raise _fails_on_slices(exc) from exc
    _refuse_compression(state)
    try:
        jaxpr = jax.make_jaxpr(inner.update)(probe, state, probe)
    except failures as exc:
        raise _fails_on_slices(exc) from exc
    eqn = _first(jaxpr.jaxpr, _is_collective)
    if eqn is not None:
        msg = (
            f"`shard_optimizer`'s inner optimizer communicates across the ranks (a "
            f"`{eqn.primitive.name}`, as `jaxddp.allreduce_gradients()` in it would): it runs "
            "on this rank's slice of the gradient, which holds other parameters than the "
            "other ranks' slices. `shard_optimizer` reduces the gradient itself: leave "
            "`allreduce_gradients()` out of `inner`."
        )
        raise ValueError(msg)
    eqn = _first(jaxpr.jaxpr, _is_reduction)
    if eqn is not None:
        where = _jax_compat.equation_frames(eqn)
        staged = f", staged at {' <- '.join(where)}" if where else ""
        msg = (
            f"`shard_optimizer`'s inner optimizer computes across the elements of its input "
            f"(a `{eqn.primitive.name}`{staged}): on a sharded optimizer it would see this "
            "rank's slice of the gradient only, not the whole gradient. That is what "
            "`optax.clip_by_global_norm`, LAMB's and LARS's trust ratios "
            "(`scale_by_trust_ratio`), adafactor and `apply_if_finite` do." + _FIX
        )
        raise ValueError(msg)
    masked = [x for x in jax.tree_util.tree_leaves(state, is_leaf=_is_masked) if _is_masked(x)]
    if masked:
        msg = (
            f"`shard_optimizer` cannot run an inner optimizer that holds a "
            f"{type(masked[0]).__name__} (`optax.masked`, `optax.multi_transform`, adamw's "
            "`mask`): their masks and labels name parameter leaves, which a rank's packed "
            f"slice of the gradient no longer has. {_UNSHARDED}"
        )
        raise ValueError(msg)


def _fails_on_slices(exc: Exception) -> ValueError:
    return ValueError(
        "`shard_optimizer`'s inner optimizer fails on a rank's packed slice of the "
        f"parameters (a tuple of 1-D arrays, one per dtype): {type(exc).__name__}: "
        f"{str(exc).splitlines()[0].rstrip('.')}. Optimizers that name parameter leaves "
        "(`optax.masked`, `optax.multi_transform`, adamw's `mask` as a tree), or whose update "
        "needs more than the gradients, state and parameters (L-BFGS's line search), "
        f"cannot be sharded. {_UNSHARDED}"
    )


def _refuse_compression(state: Any) -> None:
    """An ``allreduce_gradients(compression=...)`` inside ``inner`` would reduce each rank's
    slice with the other ranks' slices, which hold other parameters."""
    is_compression = lambda x: isinstance(x, CompressionState)
    if any(is_compression(x) for x in jax.tree_util.tree_leaves(state, is_leaf=is_compression)):
        msg = (
            "`shard_optimizer` has no gradient compression: its inner optimizer holds "
            "`jaxddp.allreduce_gradients(compression=...)`, which would reduce this rank's "
            "slice of the gradient with the other ranks' slices (other parameters). "
            "`shard_optimizer` reduces the gradient itself, at full width. Compress with "
            "`optax.chain(jaxddp.allreduce_gradients(compression=...), inner)` (the full "
            "optimizer state on every rank), or shard without compression."
        )
        raise ValueError(msg)


def _is_masked(x: Any) -> bool:
    return isinstance(x, _MASKED)
