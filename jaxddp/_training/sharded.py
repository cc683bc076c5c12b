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

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.core import Tracer

from .._collectives import api as _comm
from .._collectives import signature as _signature
from .._collectives._jax import ops
from .._collectives.wire import chunks, from_wire, to_wire, wire_dtype
from .gradients import check_flag, filled
from .sharded_check import check_elementwise

__all__ = ["ShardedOptimizer", "ShardedState", "shard_optimizer"]


class ShardedState(NamedTuple):
    """The state of :func:`shard_optimizer`: ``inner``'s state for this rank's slice of the
    packed parameters (a tuple of 1-D arrays, one per parameter dtype, where ``inner.init``
    would have had the parameters' tree). It differs from rank to rank: save it with
    :meth:`ShardedOptimizer.gather_state`, restore it with :meth:`ShardedOptimizer.shard_state`."""

    inner: Any


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each parameter leaf lies in the packed vectors, and this rank's slice."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[np.dtype, tuple[int, ...]], ...]  # (dtype, leaf indices)
    lengths: tuple[int, ...]  # real elements per group
    chunk: tuple[int, ...]  # elements per rank per group (padded length / size)
    rank: int
    size: int

    def pack(self, leaves: list[Any], dtypes: Any = None) -> list[Any]:
        """The leaves as one padded flat vector per group (NumPy for NumPy leaves)."""
        out = []
        for g, (own, members) in enumerate(self.groups):
            xp = np if all(isinstance(leaves[i], np.ndarray) for i in members) else jnp
            dtype = own if dtypes is None else dtypes[g]
            pad = self.chunk[g] * self.size - self.lengths[g]
            parts = [xp.ravel(xp.asarray(leaves[i], dtype)) for i in members]
            parts.append(xp.zeros((pad,), dtype))
            out.append(xp.concatenate(parts))
        return out

    def mine(self, vectors: list[Any]) -> tuple[Any, ...]:
        """This rank's slice of each padded vector."""
        return tuple(
            v[self.rank * c : (self.rank + 1) * c] for v, c in zip(vectors, self.chunk, strict=True)
        )

    def unpack(self, vectors: list[Any]) -> Any:
        """Padded flat vectors (one per group) cut back into the parameters' tree."""
        leaves: list[Any] = [None] * len(self.shapes)
        for (_, members), v in zip(self.groups, vectors, strict=True):
            offset = 0
            for i in members:
                n = int(np.prod(self.shapes[i], dtype=np.int64))
                leaves[i] = v[offset : offset + n].reshape(self.shapes[i])
                offset += n
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _layout(params: Any, rank: int, size: int, what: str = "params") -> _Layout:
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    shapes, order, members = [], [], {}
    for i, (path, leaf) in enumerate(flat):
        dtype = np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
        if not jnp.issubdtype(dtype, jnp.inexact):
            msg = (
                f"`shard_optimizer` got a {dtype.name} leaf at "
                f"`{jax.tree_util.keystr(path)}` in `{what}`: it shards floating-point "
                "parameters only. Leave other leaves out of the optimized tree (with Flax "
                "NNX, `nnx.Optimizer(model, tx, wrt=nnx.Param)`), or use "
                "`optax.chain(jaxddp.allreduce_gradients(), inner)`."
            )
            raise TypeError(msg)
        shapes.append(tuple(np.shape(leaf)))
        if dtype not in members:
            order.append(dtype)
            members[dtype] = []
        members[dtype].append(i)
    lengths = tuple(sum(int(np.prod(shapes[i], dtype=np.int64)) for i in members[d]) for d in order)
    return _Layout(
        treedef=treedef,
        shapes=tuple(shapes),
        groups=tuple((d, tuple(members[d])) for d in order),
        lengths=lengths,
        chunk=tuple(-(-n // size) for n in lengths),
        rank=rank,
        size=size,
    )


# ---- the two moves, traced (jaxddp's primitives) or concrete (mpi4py) ---------------------


def _columns(x: Any, call: Any) -> Any:
    """``call`` on the ``(size, c)`` buffer ``x``, in column chunks an MPI count can hold."""
    spans = chunks(x.shape[1])
    if len(spans) == 1:
        return call(x)
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.concatenate([call(x[:, a:b]) for a, b in spans], axis=1)


def _alltoall(rows: list[Any], comm: tuple[Any, Any]) -> list[Any]:
    """Row ``j`` of each ``(size, c)`` buffer to rank ``j``; row ``i`` back from rank ``i``."""
    jax_comm, host_comm = comm
    out = []
    for x in rows:
        dtype = x.dtype
        if isinstance(x, np.ndarray):

            def move(b: Any) -> Any:
                send = np.ascontiguousarray(b)
                recv = np.empty_like(send)
                host_comm.Alltoall(send, recv)
                return recv

        else:

            def move(b: Any) -> Any:
                return ops.alltoall_many([b], jax_comm)[0]

        out.append(from_wire(_columns(to_wire(x, arithmetic=False), move), dtype, arithmetic=False))
    return out


def _allgather(slices: list[Any], comm: tuple[Any, Any], size: int) -> list[Any]:
    """Every rank's slice of each group, in rank order, as one flat vector."""
    jax_comm, host_comm = comm
    out = []
    for x in slices:
        dtype = x.dtype
        if not x.size:  # a dtype of empty leaves only: nothing to send
            out.append(x)
            continue
        if isinstance(x, np.ndarray):

            def move(b: Any) -> Any:
                send = np.ascontiguousarray(b[0])
                recv = np.empty((size, *send.shape), send.dtype)
                host_comm.Allgather(send, recv)
                return recv

        else:

            def move(b: Any) -> Any:
                return ops.allgather_many([b[0]], jax_comm)[0]

        rows = _columns(to_wire(x, arithmetic=False)[None], move)
        out.append(from_wire(rows, dtype, arithmetic=False).reshape(-1))
    return out


def _mean_slices(vectors: list[Any], layout: _Layout, comm: tuple[Any, Any]) -> list[Any]:
    """This rank's slice of the mean over the ranks of each padded vector: an alltoall,
    then a sum in rank order (in float32 for narrower floats, as ``allreduce`` sums them)
    divided by the world size, rounded once to the vector's dtype."""
    size = layout.size
    if size == 1:
        return [jnp.asarray(v) for v in vectors]
    live = [i for i, v in enumerate(vectors) if v.size]  # a dtype of empty leaves only: none
    moved = iter(_alltoall([vectors[i].reshape(size, -1) for i in live], comm))
    out = []
    for v in vectors:
        if not v.size:
            out.append(jnp.asarray(v))
            continue
        r = jnp.asarray(next(moved))
        wide = wire_dtype(r.dtype, arithmetic=True)
        total = r[0].astype(wide)
        for j in range(1, size):
            total = total + r[j].astype(wide)
        out.append((total / size).astype(r.dtype))
    return out


def _global_norm(slices: list[Any], comm: Any) -> Any:
    """The norm of the whole (mean) gradient from every rank's slices: each rank's sum of
    squares, summed over the ranks (the padding is zeros)."""
    squares = sum(
        (jnp.sum(jnp.real(s * jnp.conj(s)) if jnp.iscomplexobj(s) else s * s) for s in slices),
        start=jnp.zeros((), jnp.float32),
    )
    total = _comm.reduce_all({"sq": squares}, "sum", comm=comm, check=False)["sq"]
    return jnp.sqrt(jnp.asarray(total))


def _clip(slices: list[Any], max_norm: float, comm: Any) -> list[Any]:
    """``optax.clip_by_global_norm(max_norm)`` of the whole gradient, on this rank's slices."""
    g_norm = _global_norm(slices, comm)
    trigger = jnp.squeeze(g_norm < max_norm)
    return [jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm) for t in slices]


class ShardedOptimizer(optax.GradientTransformation):
    """What :func:`shard_optimizer` returns: an ``optax.GradientTransformation`` with two
    more methods, collective over the ranks, to turn its sharded state into the full one
    (for a checkpoint any world size can restore) and back."""

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
    def __init__(self, inner: Any, clip: float | None, comm: Any, check: bool) -> None:
        self.inner, self.clip, self.comm, self.check = inner, clip, comm, check

    def layout(self, params: Any, what: str = "params") -> tuple[_Layout, tuple[Any, Any]]:
        rank, size, jax_comm, host_comm = _comm.channels(self.comm)
        return _layout(params, rank, size, what), (jax_comm, host_comm)

    def init(self, params: Any) -> ShardedState:
        layout, _ = self.layout(params)
        mine = layout.mine(layout.pack(jax.tree_util.tree_leaves(params)))
        mine = tuple(jnp.asarray(x) for x in mine)
        check_elementwise(self.inner, mine, clip=self.clip)
        return ShardedState(self.inner.init(mine))

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
        grads = _mean_slices(layout.pack(leaves), layout, channels)
        if self.clip is not None:
            grads = _clip(grads, self.clip, self.comm)
        mine_params = None
        if params is not None:
            mine_params = tuple(
                jnp.asarray(x) for x in layout.mine(layout.pack(jax.tree_util.tree_leaves(params)))
            )
        out, inner_state = self.inner.update(tuple(grads), state.inner, mine_params)
        out = [np.asarray(x) if concrete else x for x in out]
        full = _allgather(out, channels, layout.size) if layout.size > 1 else out
        full = [jnp.asarray(x) for x in full]
        return layout.unpack(full), ShardedState(inner_state)

    def gather(self, state: ShardedState, params: Any) -> Any:
        layout, channels = self.layout(params)

        def full(slices: Any) -> Any:
            xs = [np.asarray(x) if not isinstance(x, Tracer) else x for x in slices]
            vectors = _allgather(xs, channels, layout.size) if layout.size > 1 else xs
            return layout.unpack([jnp.asarray(v) for v in vectors])

        return _map_params(self.inner, full, state.inner, unwrap=True)

    def shard(self, full: Any, params: Any) -> ShardedState:
        layout, _ = self.layout(params)

        def mine(tree: Any) -> Any:
            leaves = jax.tree_util.tree_leaves(tree)
            dtypes = [np.dtype(leaves[members[0]].dtype) for _, members in layout.groups]
            return tuple(jnp.asarray(x) for x in layout.mine(layout.pack(leaves, dtypes)))

        return ShardedState(_map_params(self.inner, mine, full))


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


def shard_optimizer(
    inner: optax.GradientTransformation,
    *,
    clip_global_norm: float | None = None,
    comm: Any = None,
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
    the packed slice no longer has.

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
      rank; ``tx.gather_state(state, params)`` gives the full one (for a checkpoint),
      ``tx.shard_state(full, params)`` this rank's share of a full one.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxddp
      >>> params = {"w": jnp.ones(3), "frozen": jnp.ones(2)}
      >>> tx = jaxddp.shard_optimizer(optax.sgd(0.1))
      >>> state = tx.init(params)
      >>> updates, state = jax.jit(tx.update)({"w": jnp.ones(3), "frozen": None}, state, params)
      >>> bool((updates["frozen"] == 0).all())  # no gradient: no update, and no hang
      True
      >>> full = tx.gather_state(state, params)  # for a checkpoint: the same on every rank
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
    return ShardedOptimizer(sharder.init, sharder.update)
