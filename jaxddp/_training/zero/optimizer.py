"""The optimizer state sharded across the ranks (ZeRO stage 1), as one optax transform.

``shard_optimizer(inner)`` stands where ``optax.chain(allreduce_gradients(), inner)`` stood.
The gradient (unused parameters filled in with zeros) is packed into one flat vector per
dtype, padded to a multiple of the world size ``W``; each rank holds a contiguous ``1/W``
slice of it. A reduce-scatter (an alltoall of the ``W`` slices, then a sum in rank order
and a division by ``W``) gives each rank the mean gradient of its slice; ``inner`` runs on
that slice with the rank's slice of its state; an allgather puts every rank's updates back
into the gradient's tree. The bytes on the wire are those of one allreduce; the optimizer
state held per rank is ``1/W`` of the unsharded one (plus at most ``W - 1`` padding
elements per dtype).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.core import Tracer

from ..._collectives import api as _comm
from ..._collectives import signature as _signature
from ..._types import Communicator, PyTree
from ..gradients import check_flag, filled
from .check import check_elementwise
from .slices import Layout, allgather, clip_by_global_norm, layout_of, mean_slices
from .state import ShardedState, Slicing

__all__ = ["ShardedOptimizer", "ShardedState", "Slicing", "shard_optimizer"]


class ShardedOptimizer(optax.GradientTransformation):
    """What :func:`shard_optimizer` returns: an ``optax.GradientTransformation`` with two
    more methods, collective over the ranks, to turn its sharded state into the full one
    (the unsharded optimizer's, the same on every rank) and back."""

    __slots__ = ()

    def gather_state(self, state: ShardedState, params: Any) -> Any:
        """The full state: what ``inner.init(params)`` would hold after the same steps,
        with the parameters' tree where the sharded state holds slices. The same on every
        rank (every rank must call it). ``optax.chain(jaxddp.allreduce_gradients(),
        inner)``'s state is ``(optax.EmptyState(), full)``."""
        return _sharder(self).gather(state, params)

    def shard_state(self, full: Any, params: Any) -> ShardedState:
        """This rank's :class:`ShardedState` from a full state (see :meth:`gather_state`),
        saved at any world size or by ``chain(allreduce_gradients(), inner)``."""
        return _sharder(self).shard(full, params)


def _sharder(tx: ShardedOptimizer) -> _Sharder:
    return tx.init.__self__  # pyright: ignore[reportAttributeAccessIssue]


class _Sharder:
    def __init__(
        self, inner: Any, clip: float | None, comm: Communicator | None, check: bool
    ) -> None:
        self.inner, self.clip, self.comm, self.check = inner, clip, comm, check
        self._groups: dict[Any, tuple[int, ...]] = {}  # by the inner state's treedef

    def state(self, layout: Layout, inner_state: Any) -> ShardedState:
        """``inner_state`` as a :class:`ShardedState`, with its :class:`Slicing`."""
        treedef = jax.tree_util.tree_structure(inner_state)
        groups = self._groups.get(treedef)
        if groups is None:
            groups = self._groups[treedef] = _groups(self.inner, inner_state, len(layout.groups))
        return ShardedState(inner_state, Slicing(layout.lengths, layout.size, groups))

    def layout(self, params: Any, what: str = "params") -> tuple[Layout, tuple[Any, Any]]:
        rank, size, jax_comm, host_comm = _comm.channels(self.comm)
        return layout_of(params, rank, size, what), (jax_comm, host_comm)

    def init(self, params: Any) -> ShardedState:
        layout, _ = self.layout(params)
        mine = layout.mine(layout.pack(jax.tree_util.tree_leaves(params)))
        mine = tuple(jnp.asarray(x) for x in mine)
        check_elementwise(self.inner, mine, clip=self.clip)
        return self.state(layout, self.inner.init(mine))

    def update(self, updates: Any, state: Any, params: Any = None) -> tuple[Any, ShardedState]:
        if not isinstance(state, ShardedState):
            msg = (
                f"Expected `state` to be the ShardedState of `shard_optimizer`'s init, got a "
                f"{type(state).__name__} instead. A full state (from `gather_state` or a "
                "checkpoint) becomes one with `tx.shard_state(full, params)`."
            )
            raise TypeError(msg)
        updates = filled(updates, params)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        layout, channels = self.layout(updates, "the gradients")
        concrete = not any(isinstance(x, Tracer) for x in leaves)
        if layout.size > 1:
            _signature.check_call(
                channels[1],
                "shard_optimizer",
                what="gradient tree",
                check=self.check,
                traced=not concrete,
                op="mean",
                tree=updates,
                flat=(leaves, treedef),
            )
        if concrete:
            leaves = [np.asarray(x) for x in leaves]
        grads = mean_slices(layout.pack(leaves), layout, channels)
        if self.clip is not None:
            grads = clip_by_global_norm(grads, self.clip, self.comm)
        mine_params = None
        if params is not None:
            mine_params = tuple(
                jnp.asarray(x) for x in layout.mine(layout.pack(jax.tree_util.tree_leaves(params)))
            )
        out, inner_state = self.inner.update(tuple(grads), state.inner, mine_params)
        out = [np.asarray(x) if concrete else x for x in out]
        full = allgather(out, channels, layout.size) if layout.size > 1 else out
        full = [jnp.asarray(x) for x in full]
        return layout.unpack(full), self.state(layout, inner_state)

    def gather(self, state: ShardedState, params: Any) -> Any:
        layout, channels = self.layout(params)

        def full(slices: Any) -> Any:
            xs = [np.asarray(x) if not isinstance(x, Tracer) else x for x in slices]
            vectors = allgather(xs, channels, layout.size) if layout.size > 1 else xs
            return layout.unpack([jnp.asarray(v) for v in vectors])

        return _map_params(self.inner, full, state.inner, unwrap=True)

    def shard(self, full: Any, params: Any) -> ShardedState:
        layout, _ = self.layout(params)

        def mine(tree: PyTree) -> Any:
            leaves = jax.tree_util.tree_leaves(tree)
            dtypes = [np.dtype(leaves[members[0]].dtype) for _, members in layout.groups]
            return tuple(jnp.asarray(x) for x in layout.mine(layout.pack(leaves, dtypes)))

        return self.state(layout, _map_params(self.inner, mine, full))


def _bare(value: Any) -> Any:
    """A state entry that ``inner.init`` makes an array, as that array: ``nnx.Optimizer``
    holds each one in an ``OptState`` variable, a pytree around one leaf."""
    if isinstance(value, jax.Array | np.ndarray | np.generic | Tracer):
        return value
    leaves = jax.tree_util.tree_leaves(value)
    return leaves[0] if len(leaves) == 1 else value


def _map_params(inner: Any, f: Any, state: Any, *, unwrap: bool = False) -> Any:
    """``f`` applied to each copy of the parameters held in ``inner``'s state (found as
    ``optax.tree_map_params`` finds them); the rest of the state unchanged, or with
    ``unwrap``, as bare arrays."""
    try:
        return optax.tree_utils.tree_map_params(
            inner, f, state, is_leaf=lambda _: True, transform_non_params=_bare if unwrap else None
        )
    except Exception as exc:
        msg = (
            f"jaxddp cannot find the parameters' copies in the inner optimizer's state "
            f"({type(exc).__name__}: {exc}): its `init` must build them with tree maps over "
            "the parameters, as optax's transforms do."
        )
        raise TypeError(msg) from exc


def _groups(inner: Any, state: Any, count: int) -> tuple[int, ...]:
    """For each leaf of ``inner``'s state (in flatten order), the group whose slice it is
    (a copy of the parameters holds one slice per group), or -1 for the rest."""

    def copy(slices: Any) -> Any:
        if not isinstance(slices, tuple) or len(slices) != count:
            msg = (
                f"jaxddp expected a copy of the parameters in the inner optimizer's state to "
                f"be {count} slices (one per parameter dtype), got {slices!r} instead."
            )
            raise TypeError(msg)
        return tuple(jax.tree.map(lambda _, g=g: g, s) for g, s in enumerate(slices))

    marked = optax.tree_utils.tree_map_params(
        inner,
        copy,
        state,
        is_leaf=lambda _: True,
        transform_non_params=lambda v: jax.tree.map(lambda _: -1, v),
    )
    groups = tuple(int(g) for g in jax.tree_util.tree_leaves(marked))
    if len(groups) != len(jax.tree_util.tree_leaves(state)):  # cannot be: tree maps
        msg = "jaxddp could not tell the slices in the inner optimizer's state from the rest."
        raise AssertionError(msg)
    return groups


def shard_optimizer(
    inner: optax.GradientTransformation,
    *,
    clip_global_norm: float | None = None,
    comm: Communicator | None = None,
    check: bool | None = None,
) -> ShardedOptimizer:
    """``inner`` with its state sharded across the ranks (ZeRO stage 1), in place of
    ``optax.chain(jaxddp.allreduce_gradients(), inner)``.

    Each rank holds ``1/W`` of the optimizer state: ``inner`` runs on a contiguous slice
    of the gradient packed into one flat vector per dtype (padded to a multiple of the
    world size ``W``). ``update(grads, state, params)`` fills unused parameters with zeros,
    as :func:`jaxddp.allreduce_gradients` does, gives each rank the mean gradient of its
    slice (an alltoall of the slices, summed in rank order, divided by ``W``), runs
    ``inner`` there and all-gathers the updates into the gradients' tree, so
    ``optax.apply_updates`` and ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` work unchanged.
    The same bytes travel as in one allreduce. Works inside and outside ``jax.jit``.

    The result equals ``chain(allreduce_gradients(), inner)``'s to float rounding where
    ``inner`` is element-wise (sgd, momentum, adam, adamw, lion, schedules): the sums run in
    another order. ``init`` refuses an ``inner`` whose update computes across elements
    (``optax.clip_by_global_norm``, LAMB's and LARS's trust ratios, adafactor,
    ``apply_if_finite``: a reduction it would apply to its slice only), or that holds
    per-leaf masks (``optax.masked``, ``multi_transform``, adamw's ``mask``), whose leaves
    the packed slice no longer has, or ``allreduce_gradients(compression=...)``: the
    gradient travels at full width here (no compression).

    Args:
      inner: the optimizer, element-wise.
      clip_global_norm: clip the mean gradient to this global norm before ``inner``, as
        ``optax.clip_by_global_norm`` first in ``inner`` would: each rank's sum of squares,
        summed over the ranks (one scalar allreduce).
      comm: an mpi4py communicator to shard over; by default the world.
      check: compare the ranks' gradient trees before they travel, as
        ``allreduce_gradients`` does; defaults to ``JAXDDP_CHECK``.

    Returns:
      A :class:`ShardedOptimizer`: its state (a :class:`ShardedState`) differs from rank to
      rank. :class:`jaxddp.CheckpointManager` saves it as it is (every rank its slices) and
      restores it into ``tx.init(params)`` at any world size. ``tx.gather_state(state,
      params)`` gives the full one (the unsharded chain's), ``tx.shard_state(full, params)``
      this rank's share of a full one.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxddp
      >>> params = {"w": jnp.ones(3), "frozen": jnp.ones(2)}
      >>> tx = jaxddp.shard_optimizer(optax.sgd(0.1))
      >>> state = tx.init(params)
      >>> updates, state = jax.jit(tx.update)({"w": jnp.ones(3), "frozen": None}, state, params)
      >>> bool((updates["frozen"] == 0).all())  # no gradient: no update, and no hang
      True
      >>> full = tx.gather_state(state, params)  # the unsharded state, the same on every rank
      >>> state = tx.shard_state(full, params)  # this rank's share, at any world size
    """
    if not isinstance(inner, optax.GradientTransformation):
        msg = f"Expected `inner` to be an optax.GradientTransformation, got {inner!r} instead."
        raise TypeError(msg)
    if clip_global_norm is not None and (
        isinstance(clip_global_norm, bool)
        or not isinstance(clip_global_norm, int | float)
        or not clip_global_norm > 0
    ):
        msg = f"Expected `clip_global_norm` to be a positive number, got {clip_global_norm!r}."
        raise ValueError(msg)
    check = check_flag(check)
    sharder = _Sharder(inner, clip_global_norm, comm, check)
    # a ShardedState is a pytree of arrays, as optax's OptState, but not a tuple or a mapping
    return ShardedOptimizer(sharder.init, sharder.update)  # pyright: ignore[reportArgumentType]
