"""Where each parameter leaf lies in the packed vectors of the sharded optimizer, and how
the ranks' slices of them travel: an alltoall and a sum for the mean gradient, an allgather
for the updates (traced through jaxddp's primitives, concrete through mpi4py), and the
global norm for clipping."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._collectives import api as _comm
from ..._collectives._jax import ops
from ..._collectives.wire import chunks, from_wire, to_wire, wire_dtype
from ..._types import Communicator

__all__ = [
    "Layout",
    "allgather",
    "alltoall",
    "clip_by_global_norm",
    "global_norm",
    "layout_of",
    "mean_slices",
]


@dataclasses.dataclass(frozen=True)
class Layout:
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


def layout_of(params: Any, rank: int, size: int, what: str = "params") -> Layout:
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
    return Layout(
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


def alltoall(rows: list[Any], comm: tuple[Any, Any]) -> list[Any]:
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


def allgather(slices: list[Any], comm: tuple[Any, Any], size: int) -> list[Any]:
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


def mean_slices(vectors: list[Any], layout: Layout, comm: tuple[Any, Any]) -> list[Any]:
    """This rank's slice of the mean over the ranks of each padded vector: an alltoall,
    then a sum in rank order (in float32 for narrower floats, as ``allreduce`` sums them)
    divided by the world size, rounded once to the vector's dtype."""
    size = layout.size
    if size == 1:
        return [jnp.asarray(v) for v in vectors]
    live = [i for i, v in enumerate(vectors) if v.size]  # a dtype of empty leaves only: none
    moved = iter(alltoall([vectors[i].reshape(size, -1) for i in live], comm))
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


def global_norm(slices: list[Any], comm: Communicator | None) -> Any:
    """The norm of the whole (mean) gradient from every rank's slices: each rank's sum of
    squares, summed over the ranks (the padding is zeros)."""
    squares = sum(
        (jnp.sum(jnp.real(s * jnp.conj(s)) if jnp.iscomplexobj(s) else s * s) for s in slices),
        start=jnp.zeros((), jnp.float32),
    )
    total = _comm.reduce_all({"sq": squares}, "sum", comm=comm, check=False)["sq"]
    return jnp.sqrt(jnp.asarray(total))


def clip_by_global_norm(slices: list[Any], max_norm: float, comm: Communicator | None) -> list[Any]:
    """``optax.clip_by_global_norm(max_norm)`` of the whole gradient, on this rank's slices."""
    g_norm = global_norm(slices, comm)
    trigger = jnp.squeeze(g_norm < max_norm)
    return [jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm) for t in slices]
