"""Gradients that every rank can reduce: unused parameters filled in, then one allreduce.

A rank that did not run a branch of the model has no gradient for that branch's
parameters. If it then reduces a smaller tree than the other ranks, they call different MPI
operations and hang. :func:`allreduce_gradients` fills each missing leaf with
``zeros_like(param)`` first, inside the optax chain, so nobody has to do it by hand.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.core import Tracer

from .._base import settings as _settings
from .._collectives import api as _comm
from .._collectives.checks import check_op
from .._types import Communicator, PyTree, ReduceOp
from . import compression as _compression
from .compression import PowerSGD

__all__ = ["allreduce_gradients", "check_flag", "filled", "resolve_unused_parameters"]

CHECK_VARIABLE = _settings.CHECK.name


def _is_missing(leaf: Any) -> bool:
    return leaf is None or getattr(leaf, "dtype", None) == jax.dtypes.float0


def resolve_unused_parameters(grads: Any, params: Any) -> Any:
    """Returns ``grads`` with exactly the structure of ``params``; missing gradients are zeros.

    A gradient is missing where ``grads`` holds ``None`` (for a leaf or a whole subtree),
    lacks a key that ``params`` has, or holds a ``float0`` leaf (the cotangent of an
    integer parameter). There the result is ``zeros_like(param)``, with the parameter's
    shape and dtype. Present gradients pass through unchanged. Works under ``jax.jit`` on
    nested dicts, lists, tuples, NamedTuples and ``flax.nnx.State``.

    Raises:
      ValueError: a present gradient's shape differs from its parameter's, or ``grads`` has
        a leaf where ``params`` has none; the message names the tree path.
      TypeError: ``params`` holds a leaf that is not an array or a number (a whole Equinox
        model, say: pass ``eqx.filter(model, eqx.is_array)``); the message names the path.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"used": jnp.ones(2), "unused": {"w": jnp.ones((2, 3))}}
      >>> grads = {"used": jnp.array([0.5, 1.0]), "unused": None}
      >>> out = resolve_unused_parameters(grads, params)
      >>> out["unused"]["w"].shape, float(out["unused"]["w"].sum())
      ((2, 3), 0.0)
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(grads, is_leaf=lambda x: x is None)
    present = {tuple(path): leaf for path, leaf in flat if leaf is not None}
    used: set[tuple[Any, ...]] = set()

    def fill(path: tuple[Any, ...], param: Any) -> Any:
        path = tuple(path)
        if not _is_array_like(param):
            msg = (
                f"`params` holds a {type(param).__module__}.{type(param).__qualname__} at "
                f"`{jax.tree_util.keystr(path)}`, which is not an array: pass only the "
                "parameters' arrays. With Equinox, `eqx.filter(model, eqx.is_array)` (and "
                "gradients from `eqx.filter_grad`); with Flax NNX, `nnx.state(model, "
                "nnx.Param)`; otherwise the pytree of arrays the gradients were taken of."
            )
            raise TypeError(msg)
        grad = present.get(path)
        if grad is not None:
            used.add(path)
        if grad is None or _is_missing(grad):
            return jnp.zeros_like(param)
        if jnp.shape(grad) != jnp.shape(param):
            msg = (
                f"The gradient at `{jax.tree_util.keystr(path)}` has shape {jnp.shape(grad)} "
                f"but its parameter has shape {jnp.shape(param)}; a gradient must have its "
                "parameter's shape."
            )
            raise ValueError(msg)
        return grad

    out = jax.tree_util.tree_map_with_path(fill, params)
    extra = [p for p in present if p not in used]
    if extra:
        msg = (
            f"The gradients have a leaf at `{jax.tree_util.keystr(extra[0])}` but the "
            f"parameters have none there ({len(extra)} such leaves). Pass the parameters the "
            "gradients were taken with."
        )
        raise ValueError(msg)
    return out


def _is_array_like(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic | bool | int | float | complex)


def _has_missing(tree: PyTree) -> bool:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)
    return any(_is_missing(leaf) for leaf in leaves)


def filled(updates: Any, params: Any) -> Any:
    """An optax update's gradients with unused parameters filled with zeros
    (:func:`resolve_unused_parameters`); without ``params``, a ``ValueError`` if any is
    missing."""
    if params is not None:
        return resolve_unused_parameters(updates, params)
    if _has_missing(updates):
        msg = (
            "Some gradients are missing (None or float0 leaves) and `params` was not "
            "passed, so jaxddp cannot fill them with zeros of the right shape. Call "
            "`tx.update(grads, opt_state, params)` with the parameters."
        )
        raise ValueError(msg)
    return updates


def check_flag(check: bool | None) -> bool:
    """A transform's ``check`` argument: None takes ``JAXDDP_CHECK``."""
    if check is None:
        return _settings.check_trees()
    if not isinstance(check, bool):
        msg = f"Expected `check` to be True, False or None, got {check!r} instead."
        raise TypeError(msg)
    return check


def allreduce_gradients(
    *,
    op: ReduceOp = "mean",
    comm: Communicator | None = None,
    check: bool | None = None,
    compression: str | PowerSGD | None = None,
    error_feedback: bool = True,
) -> optax.GradientTransformation:
    """An optax transform that fills in unused parameters, then allreduces the gradients.

    Put it first in the chain: ``optax.chain(jaxddp.allreduce_gradients(), optax.adam(1e-3))``.
    ``update(updates, state, params)`` gives missing gradients (``None``, absent keys,
    ``float0``) the value ``zeros_like(param)``, then reduces every leaf across the ranks,
    small leaves packed together into few MPI calls. Works inside ``jax.jit`` and inside
    ``optax.MultiSteps`` (which then communicates only on the steps that apply an update).

    Args:
      op: ``"mean"`` (the sum divided by the world size, the data-parallel gradient) or
        ``"sum"``; ``"max"`` and ``"min"`` are accepted too.
      comm: an mpi4py communicator to reduce over; by default jaxddp's private clone of
        ``COMM_WORLD``. Do not use the same communicator for mpi4py calls. The check, too,
        runs over its ranks only (on a private duplicate of it).
      check: compare the ranks' gradient trees (paths, shapes, dtypes) and ``op`` before
        reducing and raise :class:`jaxddp.TreeMismatchError` on every rank if they differ,
        instead of hanging or reducing garbage (a float32 leaf against an int32 one, a
        (2, 3) against a (3, 2)): the signature check every jaxddp collective makes. It
        runs when the update is traced, so a jitted step pays for it once per compilation
        (one small message) and not per step; an update called outside ``jax.jit`` pays
        one small message per call. Defaults to the environment variable ``JAXDDP_CHECK``:
        on, unless set to ``0``, ``false``, ``no`` or ``off``.

      compression: how the floating gradients travel. ``None`` (the default): exactly, at
        full width. ``"bf16"`` or ``"fp16"``: cast to bfloat16 or float16, a reduce-scatter
        and an allgather in that dtype, summed in float32 in rank order on the rank that
        owns each block, so half the bytes of a float32 allreduce cross the wire.
        :class:`jaxddp.PowerSGD`: each matrix as two low-rank float32 factors. Leaves of
        other dtypes (integers, float64, complex) and, for PowerSGD, vectors and small
        matrices are reduced exactly. A finite value beyond float16's range saturates to
        its largest (the excess is carried over to the next steps); an infinity or a NaN
        in any rank's gradient gives a non-finite result on every rank, as without
        compression. Only ``op`` ``"mean"`` and ``"sum"``. See the compression page.
      error_feedback: with ``compression``, keep each rank's compression error in the
        state and add it to its next gradient (Karimireddy et al., 2019), so that what
        one step rounds away a later one sends, and training follows the uncompressed
        run. Turn it off only to measure what it brings.

    Returns:
      An ``optax.GradientTransformation``: with an empty state without ``compression``;
      with ``compression``, a ``CompressionState`` holding each rank's residual (as a
      :class:`jaxddp.ShardedState`, which ``CheckpointManager`` saves as each rank's own)
      and PowerSGD's ``Q``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxddp
      >>> params = {"w": jnp.ones(3), "frozen": jnp.ones(2)}
      >>> tx = optax.chain(jaxddp.allreduce_gradients(), optax.sgd(0.1))
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.ones(3), "frozen": None}
      >>> updates, state = jax.jit(tx.update)(grads, state, params)
      >>> bool((updates["frozen"] == 0).all())  # no gradient: no update, and no hang
      True
    """
    check_op(op)
    check = check_flag(check)
    compression = _compression.check_compression(compression)
    if compression is not None:
        return _compressed(op, comm, check, compression, error_feedback)

    def init_fn(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates = filled(updates, params)
        reduced = _comm.reduce_all(updates, op, comm=comm, check=check, what="gradient tree")
        return reduced, state

    return optax.GradientTransformation(init_fn, update_fn)


def _compressed(
    op: ReduceOp,
    comm: Communicator | None,
    check: bool,
    compression: str | PowerSGD,
    error_feedback: bool,
) -> optax.GradientTransformation:
    if op not in ("mean", "sum"):
        msg = f"Expected `op` to be 'mean' or 'sum' with `compression`, got {op!r} instead."
        raise ValueError(msg)
    if not isinstance(error_feedback, bool):
        msg = f"Expected `error_feedback` to be True or False, got {error_feedback!r} instead."
        raise TypeError(msg)

    def init_fn(params: Any) -> Any:
        size = _comm.channels(comm)[1]
        return _compression.init_state(params, compression, error_feedback, size)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates = filled(updates, params)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        reduced, state = _compression.compressed_allreduce(
            leaves,
            state,
            compression=compression,
            error_feedback=error_feedback,
            op=op,
            comm=comm,
            check=check,
            tree=updates,
            treedef=treedef,
        )
        return jax.tree_util.tree_unflatten(treedef, reduced), state

    jitted = jax.jit(update)

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        traced = any(isinstance(x, Tracer) for x in jax.tree_util.tree_leaves((updates, state)))
        # outside jax.jit, compiled once per tree: the narrow transport is traced collectives
        return update(updates, state, params) if traced else jitted(updates, state, params)

    return optax.GradientTransformation(init_fn, update_fn)
