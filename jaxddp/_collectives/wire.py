"""How a tree of leaves travels through MPI: which leaves share a call, in which dtype.

Pure planning on shapes and dtypes, and the one cast of a leaf to and from its wire dtype,
shared by the compiled path (jax arrays and tracers), the host path (NumPy arrays) and the
sharded optimizer, so that all send exactly the same messages.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ALONE_BYTES",
    "BUCKET_BYTES",
    "MAX_COUNT",
    "MPI_DTYPES",
    "chunks",
    "from_wire",
    "fused",
    "plan",
    "split",
    "to_wire",
    "wire_dtype",
]

# Leaves of at least this many bytes travel alone; smaller ones of one dtype are packed into
# flat buckets of up to BUCKET_BYTES, so that a tree of many small leaves costs a few MPI
# calls instead of one per leaf, and large leaves are never copied into a bucket.
# (Chosen from measurements: see benchmarks/.)
ALONE_BYTES = 1 << 20
BUCKET_BYTES = 4 << 20

# The most elements one MPI call may carry: MPI counts are C ints, and mpi4jax's handlers
# cast the count to int, so a larger buffer ends the job inside MPI. Larger buffers travel
# in chunks of at most this many elements (see chunks).
MAX_COUNT = (1 << 31) - 1

# dtypes MPI (and mpi4jax) can carry as they are.
MPI_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        "float32", "float64", "complex64", "complex128", "bool",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    )
)  # fmt: skip
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def wire_dtype(dtype: Any, arithmetic: bool) -> np.dtype:
    """The dtype a leaf travels in. bfloat16, float16 and the like are reduced in float32
    (exact for max and min, more accurate for sums) and moved bit for bit (as unsigned
    integers of their size) when nothing is computed on them."""
    dtype = np.dtype(dtype)
    if dtype in MPI_DTYPES:
        return dtype
    if arithmetic:
        return np.dtype(np.float32 if jnp.issubdtype(dtype, jnp.floating) else np.int64)
    return np.dtype(_UNSIGNED[dtype.itemsize])


def plan(leaves: list[Any]) -> list[list[int]]:
    """Groups leaf indices into MPI calls: one per large leaf, one per bucket of small ones.

    Depends only on shapes and dtypes, so it is the same on every rank whose tree matches.
    Empty leaves need no call and are left out.
    """
    groups: list[list[int]] = []
    open_bucket: dict[Any, tuple[list[int], int]] = {}
    for i, leaf in enumerate(leaves):
        nbytes = leaf.size * leaf.dtype.itemsize
        if leaf.size == 0:
            continue
        if nbytes >= ALONE_BYTES:
            groups.append([i])
            continue
        bucket, filled = open_bucket.get(leaf.dtype, ([], 0))
        if bucket and filled + nbytes > BUCKET_BYTES:
            groups.append(bucket)
            bucket, filled = [], 0
        bucket.append(i)
        open_bucket[leaf.dtype] = (bucket, filled + nbytes)
    groups.extend(bucket for bucket, _ in open_bucket.values())
    return groups


def split(flat: Any, like: list[Any]) -> list[Any]:
    """A flat buffer (NumPy or jax) cut back into pieces shaped as the arrays of ``like``,
    which were packed into it in order."""
    pieces, offset = [], 0
    for x in like:
        pieces.append(flat[offset : offset + x.size].reshape(x.shape))
        offset += x.size
    return pieces


def chunks(size: int, limit: int | None = None) -> list[tuple[int, int]]:
    """``(start, stop)`` of the pieces a flat buffer of ``size`` elements travels in: one
    piece unless it has more than ``limit`` (by default :data:`MAX_COUNT`) elements.

    Example:
      >>> chunks(10, limit=4)
      [(0, 4), (4, 8), (8, 10)]
      >>> chunks(2**31 + 5)
      [(0, 2147483647), (2147483647, 2147483653)]
    """
    limit = MAX_COUNT if limit is None else limit
    return [(start, min(start + limit, size)) for start in range(0, max(size, 1), limit)]


def to_wire(x: Any, arithmetic: bool) -> Any:
    """A leaf (a NumPy or jax array) in the dtype :func:`wire_dtype` says: converted when the
    collective computes on it (``arithmetic``), else reinterpreted bit for bit."""
    wire = wire_dtype(x.dtype, arithmetic)
    if wire == x.dtype:
        return x
    if arithmetic:
        return x.astype(wire)
    return x.view(wire) if isinstance(x, np.ndarray) else jax.lax.bitcast_convert_type(x, wire)


def from_wire(x: Any, dtype: Any, arithmetic: bool) -> Any:
    """A leaf that travelled as :func:`to_wire` made it, back in ``dtype``."""
    if x.dtype == dtype:
        return x
    if arithmetic:
        return x.astype(dtype)
    return x.view(dtype) if isinstance(x, np.ndarray) else jax.lax.bitcast_convert_type(x, dtype)


def fused(
    leaves: list[jax.Array],
    collective: Any,
    *,
    arithmetic: bool,
    labels: list[str] | None = None,
) -> list[jax.Array]:
    """Applies an elementwise collective to every leaf, in as few calls as ``plan`` says.

    ``collective`` takes the list of flat buffers and returns them reduced (or moved);
    ``arithmetic`` says whether it computes on the values (a reduction) or only moves them
    (a broadcast), which decides how dtypes unknown to MPI travel. With ``labels`` (one per
    leaf), ``collective`` also takes each buffer's description (its leaves' labels), and a
    call whose leaves are all empty still makes one call, of no element, so that it meets
    the other ranks' call at the same point.
    """
    wire = [to_wire(x, arithmetic) for x in leaves]
    groups = plan(wire)
    if labels is not None and not groups and wire:
        groups = [[0]]
    buffers = [
        wire[g[0]] if len(g) == 1 else jnp.concatenate([wire[i].ravel() for i in g]) for g in groups
    ]
    out: list[Any] = list(wire)  # empty leaves stay as they are
    described = (
        None if labels is None else [_short(", ".join(labels[i] for i in g)) for g in groups]
    )
    for group, flat in zip(groups, _chunked(collective, buffers, described), strict=True):
        pieces = [flat] if len(group) == 1 else split(flat, [wire[i] for i in group])
        for i, piece in zip(group, pieces, strict=True):
            out[i] = piece
    return [from_wire(x, like.dtype, arithmetic) for x, like in zip(out, leaves, strict=True)]


def _short(text: str, limit: int = 160) -> str:
    """A buffer's description, at most ``limit`` characters (a compiled program holds one per
    call): a long one is cut, with a digest of the whole, so two long ones still differ.

    Example:
      >>> _short("float32[3]"), len(_short("float32[3], " * 40))
      ('float32[3]', 160)
    """
    if len(text) <= limit:
        return text
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    tail = f"... ({len(text)} characters, {digest})"
    return text[: limit - len(tail)] + tail


def _chunked(
    collective: Any, buffers: list[jax.Array], described: list[str] | None = None
) -> list[jax.Array]:
    """``collective(buffers)`` (with ``described``, when given), with each buffer of more
    than :data:`MAX_COUNT` elements cut into chunks that an MPI call can count, and put
    back together after."""
    bounds = [chunks(b.size) for b in buffers]

    def call(pieces: list[jax.Array], texts: list[str]) -> Any:
        return collective(pieces) if described is None else collective(pieces, texts)

    if all(len(b) == 1 for b in bounds):
        return call(buffers, described or [])
    pieces, texts = [], []
    for k, (b, spans) in enumerate(zip(buffers, bounds, strict=True)):
        flat = b if len(spans) == 1 else b.ravel()
        pieces.extend([b] if len(spans) == 1 else [flat[i:j] for i, j in spans])
        texts.extend([described[k] if described else ""] * len(spans))
    done = iter(call(pieces, texts))
    out = []
    for b, spans in zip(buffers, bounds, strict=True):
        parts = [next(done) for _ in spans]
        out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts).reshape(b.shape))
    return out
