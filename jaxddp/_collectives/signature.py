"""Do all ranks call the same collective? A check before every collective sends anything.

Ranks that pass a float32 leaf against an int32 one, ``"sum"`` against ``"max"``, or a
different ``root`` make MPI combine bytes that do not belong together (garbage, exit status
0) or wait for each other forever; a shape or tree of another size ends in MPI's own abort
("Message truncated"). Before its data travel, every jaxddp collective makes its ranks
agree on its *signature*: which collective, its ``op`` and ``root``, and the path, dtype and
shape of every leaf (never values). The first message is the same MPI call on every rank
whatever the signature, so it cannot itself be mismatched; on a difference every rank
gathers every rank's signature and raises :class:`TreeMismatchError` naming the first
difference and each rank's value. Nothing else was sent, so the communicator is as clean
as before the call.

* Outside ``jax.jit`` the signature's 62-bit digest travels in a block of :data:`BLOCK`
  bytes that every rank gathers (``Allgather``); a small reduction (a few metrics, a masked
  mean's sum and count) travels in the same block and every rank reduces the gathered rows
  itself, so such a call is still one message. Larger data travel after it. The digest of
  a signature is cached, so a repeated call pays a dictionary look-up. Above
  :data:`FUSED_RANKS` ranks the digest goes alone, as an ``Allreduce`` of two int64.
* Inside ``jax.jit`` the signature is static: the check runs while the step is traced,
  once per compilation, and costs a compiled step nothing. It is an ``Iallreduce`` with
  ``MPI.MAX`` of ``[h, -h]`` (``[max h, -min h]``: equal digests exactly when the two
  agree) given up on after ``JAXDDP_CHECK_TIMEOUT`` seconds: a rank that does not arrive
  (a step traced on some ranks only) makes the others raise TimeoutError.

``JAXDDP_CHECK=0`` turns every such check off.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._base import settings as _settings
from .._types import Communicator, PyTree

__all__ = [
    "TreeMismatchError",
    "agree",
    "check_call",
    "describe_tree",
    "enabled",
    "explain",
    "wait",
]


class TreeMismatchError(RuntimeError):
    """Ranks passed trees of different structure, shapes or dtypes to a collective, or
    called different collectives (another ``op``, another ``root``)."""


TIMEOUT_VARIABLE = _settings.CHECK_TIMEOUT.name


def describe_tree(tree: PyTree) -> list[tuple[str, str]]:
    """``(path, "dtype[shape]")`` for every leaf, in order; ``None`` leaves say ``None``.

    Example:
      >>> import jax.numpy as jnp
      >>> describe_tree({"w": jnp.zeros((2, 3)), "b": None})
      [("['b']", 'None'), ("['w']", 'float32[2,3]')]
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return [(jax.tree_util.keystr(path), leaf_kind(leaf)) for path, leaf in flat]


_NUMBERS = (bool, int, float, complex)


def leaf_kind(leaf: Any) -> str:
    """``"dtype[shape]"`` of an array (a Python number as the NumPy array it travels as),
    the type's name for anything else."""
    if leaf is None:
        return "None"
    if type(leaf) in _NUMBERS:
        return f"{np.dtype(type(leaf)).name}[]"
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return type(leaf).__name__
    name = np.dtype(dtype).name if isinstance(dtype, np.dtype) else str(dtype)  # key<fry>
    return f"{name}[{','.join(map(str, shape))}]"


def explain(descriptions: list[list[tuple[str, str]]], what: str) -> str:
    """The message for ranks whose tree descriptions differ: the first differing path first."""
    per_rank = [dict(d) for d in descriptions]
    paths: list[str] = []
    seen: set[str] = set()
    for description in descriptions:
        for path, _ in description:
            if path not in seen:
                seen.add(path)
                paths.append(path)
    differing = [p for p in paths if len({d.get(p, "nothing") for d in per_rank}) > 1]
    orders = {tuple(p for p, _ in d) for d in descriptions}
    if not differing and len(orders) > 1:
        return (
            f"The {what} has the same leaves on every rank but in a different order "
            "(a dict built in a rank-dependent order?). Every rank must pass a tree of "
            "the same structure."
        )
    first = differing[0]
    holders = ", ".join(f"rank {r} has {d.get(first, 'nothing')}" for r, d in enumerate(per_rank))
    return (
        f"The {what} differs across ranks at `{first}`: {holders}. "
        f"{len(differing)} of {len(paths)} paths differ. Every rank must pass a tree of the "
        "same structure, shapes and dtypes to a collective, or the ranks call different MPI "
        "operations and wait for each other forever."
        + (
            " If some ranks leave gradients out (conditional branches, filters, frozen "
            "parts), pass `params` to the update so jaxddp fills them with zeros."
            if "gradient" in what
            else ""
        )
    )


@functools.cache
def enabled() -> bool:
    """``JAXDDP_CHECK``: whether collectives check their signatures (on by default); read
    once, at the first collective (a per-call read of the environment costs a microsecond
    or two). ``enabled.cache_clear()`` reads it again."""
    return _settings.check_trees()


# A signature: (call, op, root, [(path, kind), ...]), where `call` names the collective.
# Portable: the same bytes on every rank for the same call (no ids, no hash randomization),
# so its digest is too.
Signature = tuple[str, Any, Any, list[tuple[str, str]]]


def check_call(
    comm: Communicator,
    call: str,
    *,
    what: str,
    traced: bool,
    tree: PyTree,
    flat: tuple[list[Any], Any],
    op: Any = None,
    root: Any = None,
    check: bool | None = None,
    payload: np.ndarray | None = None,
) -> np.ndarray | None:
    """:func:`agree` on the signature of collective ``call`` of ``tree`` (``flat``: its leaves
    and treedef), unless ``check`` (None: ``JAXDDP_CHECK``) is off; a collective over
    ``comm`` when on. Returns what :func:`agree` does (None when off)."""
    if check is False or (check is None and not enabled()):
        return None
    leaves, treedef = flat
    # what decides each leaf's part of the signature, cheaply and hashably (this rank only):
    # an array's shape and dtype, anything else's type
    kinds = tuple([(type(x), getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves])
    key = (call, traced, op, root, treedef, kinds)

    def signature() -> Signature:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        return (call, op, root, [(jax.tree_util.keystr(p), leaf_kind(x)) for p, x in flat])

    return agree(comm, key, signature, what=what, traced=traced, payload=payload)


_MAX_CACHED = 4096
_digests: dict[Any, tuple[int, Signature]] = {}


def _digest(signature: Signature) -> int:
    raw = hashlib.blake2b(pickle.dumps(signature, protocol=4), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2  # 62 bits: its negative is an int64 too


def _cached(key: Any, signature: Callable[[], Signature]) -> tuple[int, Signature]:
    try:
        found = _digests.get(key)
    except TypeError:  # a tree node whose auxiliary data cannot be hashed: no caching
        mine = signature()
        return _digest(mine), mine
    if found is None:
        mine = signature()
        if len(_digests) >= _MAX_CACHED:
            _digests.clear()
        found = _digests[key] = (_digest(mine), mine)
    return found


@functools.cache
def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


# Outside jax.jit, on up to FUSED_RANKS ranks, the digest travels in a block of BLOCK bytes
# that every rank gathers: the digest in its first 8 bytes, and from byte HEADER on the data
# of a small reduction (a few metrics, a masked mean's sum and count) when they fit, which
# every rank then reduces itself, in rank order: identical on every rank, one message.
BLOCK = 128
HEADER = 16  # a multiple of every itemsize, complex128's included
PAYLOAD = BLOCK - HEADER
FUSED_RANKS = 64


class _Blocks:
    """The gather's buffers for one world size, allocated once (an eager collective is never
    called from two threads on one communicator at a time), with views made once: every
    NumPy call on the way costs a microsecond or more."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.send = np.zeros(BLOCK, np.uint8)
        self.received = np.zeros(size * BLOCK, np.uint8)
        self.send_head = self.send.view(np.int64)
        self.heads = self.received.view(np.int64)[:: BLOCK // 8]  # each rank's digest
        self.rows: dict[Any, np.ndarray] = {}

    def payloads(self, dtype: Any, count: int) -> np.ndarray:
        """Every rank's payload of ``count`` items of ``dtype``, as rows (a view)."""
        view = self.rows.get(dtype)
        if view is None:
            itemsize = np.dtype(dtype).itemsize
            whole = self.received.view(dtype).reshape(self.size, BLOCK // itemsize)
            view = self.rows[dtype] = whole[:, HEADER // itemsize :]
        return view[:, :count]


@functools.cache
def _blocks(size: int) -> _Blocks:
    return _Blocks(size)


def _gather(comm: Communicator, digest: int, payload: np.ndarray | None) -> tuple[bool, Any]:
    """Outside jit: whether every rank has this digest, and (when ``payload`` travelled)
    every rank's payload as rows of its dtype."""
    size = comm.Get_size()
    if size > FUSED_RANKS:  # many ranks: two int64 reduced, the data travels after
        buffer = np.array([digest, -digest], np.int64)
        comm.Allreduce(_mpi().IN_PLACE, buffer, _mpi().MAX)
        return int(buffer[0]) == -int(buffer[1]), None
    blocks = _blocks(size)
    blocks.send_head[0] = digest
    if payload is not None:
        blocks.send[HEADER : HEADER + payload.nbytes] = payload.reshape(-1).view(np.uint8)
    comm.Allgather(blocks.send, blocks.received)
    if blocks.heads.tolist().count(digest) != size:
        return False, None
    return True, None if payload is None else blocks.payloads(payload.dtype, payload.size)


# Requests given up on at their deadline, kept with their buffers: MPI may still write into
# them if the missing ranks arrive later, so they must never be freed.
_abandoned: list[Any] = []


def _exchange(comm: Communicator, digest: int, timeout: float, what: str) -> bool:
    """Inside jit (at trace time): whether every rank of ``comm`` has this digest, from one
    ``Iallreduce`` with ``MPI.MAX`` of ``[digest, -digest]``, given up on after ``timeout``
    seconds (TimeoutError)."""
    MPI = _mpi()
    buffer = np.array([digest, -digest], np.int64)
    request = comm.Iallreduce(MPI.IN_PLACE, buffer, MPI.MAX)

    def late() -> str:
        return (
            f"Rank {comm.Get_rank()} waited {timeout:g} s in jaxddp's check of the "
            f"{what} and not every rank arrived: some rank is running different code "
            "(another branch, a loop that ended early, a step compiled again on some "
            f"ranks only, a collective called inside `jax.jit` on some ranks and outside "
            f"it on others). Raise the wait with {TIMEOUT_VARIABLE}=<seconds> if the "
            "ranks are just slow."
        )

    wait(request, buffer, timeout, late)
    return int(buffer[0]) == -int(buffer[1])


def wait(request: Any, buffers: Any, timeout: float, late: Callable[[], str]) -> None:
    """Waits for the non-blocking ``request``; after ``timeout`` seconds raises
    TimeoutError(``late()``), keeping the request and its ``buffers`` alive (MPI may still
    write into them if the missing ranks arrive later)."""
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not request.Test():
        if time.monotonic() > deadline:
            _abandoned.append((request, buffers))
            raise TimeoutError(late())
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def mismatch_message(everyone: list[Signature], what: str) -> str:
    """The first field in which the ranks' signatures differ, with each rank's value."""
    fix = (
        " Every rank must call the same collectives in the same order with the same "
        "arguments, or MPI combines bytes that do not belong together or waits forever."
    )
    for index, name in ((0, "the collective"), (1, "`op`"), (2, "`root`")):
        values = [s[index] for s in everyone]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            return (
                f"The ranks called different collectives ({what}): {name} differs "
                f"({per_rank})." + fix
            )
    return explain([s[3] for s in everyone], what)


def agree(
    comm: Communicator,
    key: Any,
    signature: Callable[[], Signature],
    *,
    what: str,
    traced: bool,
    payload: np.ndarray | None = None,
) -> np.ndarray | None:
    """Makes every rank of ``comm`` agree on a collective's signature before it sends data.

    ``key`` (hashable on this rank) caches the digest of ``signature()``. Raises
    :class:`TreeMismatchError` on every rank when the signatures differ; inside ``jax.jit``
    (``traced``), TimeoutError when some rank does not arrive within ``JAXDDP_CHECK_TIMEOUT``
    seconds. A collective over ``comm``: every rank of it must call it.

    ``payload`` (outside jit; a contiguous 1-D array, part of the signature): data that may
    travel with the digest. Returns every rank's ``payload`` as the rows of a
    ``(ranks, payload.size)`` array when it did (at most :data:`PAYLOAD` bytes, at most
    :data:`FUSED_RANKS` ranks), for the caller to reduce; None when the data must still be
    sent.
    """
    digest, mine = _cached(key, signature)
    if traced:
        same, rows = _exchange(comm, digest, _settings.check_timeout(), what), None
    else:
        fits = payload is not None and payload.nbytes <= PAYLOAD
        same, rows = _gather(comm, digest, payload if fits else None)
    if same:
        return rows
    everyone = comm.allgather(mine)
    raise TreeMismatchError(mismatch_message(everyone, what))
