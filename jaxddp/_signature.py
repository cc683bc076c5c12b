"""Do all ranks call the same collective? A check before every collective sends anything.

Ranks that pass a float32 leaf against an int32 one, ``"sum"`` against ``"max"``, or a
different ``root`` make MPI combine bytes that do not belong together (garbage, exit status
0) or wait for each other forever; a shape or tree of another size ends in MPI's own abort
("Message truncated"). Before its data travel, every jaxddp collective makes its ranks
agree on its *signature*: which collective, inside or outside ``jax.jit``, its ``op`` and
``root``, and the path, dtype and shape of every leaf (never values).

The signature travels as a 62-bit digest ``h`` in one message, the same on every rank
whatever the call: an ``Iallreduce`` with ``MPI.MAX`` of ``[h, -h]``, which gives
``[max h, -min h]``: all digests are equal exactly when the two agree. Only then do the data
travel. Otherwise every rank gathers every rank's signature and raises
:class:`TreeMismatchError` naming the first difference and each rank's value; nothing else
was sent, so the communicator is as clean as before the call.

Outside ``jax.jit`` that message is one more tiny collective per call (the digest of a
signature is cached, so a repeated call pays a dictionary look-up and that message). Inside
``jax.jit`` the signature is static: the check runs while the step is traced, once per
compilation, and costs a compiled step nothing; there a rank that does not arrive within
``JAXDDP_CHECK_TIMEOUT`` seconds (a step traced on some ranks only) makes the others raise
TimeoutError. ``JAXDDP_CHECK=0`` turns every such check off.
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

from . import _settings

__all__ = [
    "TreeMismatchError",
    "agree",
    "check_call",
    "describe_tree",
    "enabled",
    "explain",
]


class TreeMismatchError(RuntimeError):
    """Ranks passed trees of different structure, shapes or dtypes to a collective, or
    called different collectives (another ``op``, another ``root``)."""


TIMEOUT_VARIABLE = _settings.CHECK_TIMEOUT.name


def describe_tree(tree: Any) -> list[tuple[str, str]]:
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


def enabled() -> bool:
    """``JAXDDP_CHECK``: whether collectives check their signatures (on by default)."""
    return _settings.check_trees()


# A signature: (call, where, op, root, [(path, kind), ...]), where `call` names the
# collective, `where` is "inside jax.jit" or "outside jax.jit". Portable: the same bytes on
# every rank for the same call (no ids, no hash randomization), so its digest is too.
Signature = tuple[str, str, Any, Any, list[tuple[str, str]]]


def _leaf_key(x: Any) -> Any:
    """What decides a leaf's part of the signature, cheaply and hashably (this rank only)."""
    t = type(x)
    if t in _NUMBERS:
        return t
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return t
    return (shape, dtype)


def check_call(
    comm: Any,
    call: str,
    *,
    what: str,
    traced: bool,
    tree: Any,
    op: Any = None,
    root: Any = None,
    check: bool | None = None,
) -> None:
    """:func:`agree` on the signature of collective ``call`` of ``tree``, unless ``check``
    (None: ``JAXDDP_CHECK``) is off. A collective over ``comm`` when on."""
    if check is False or (check is None and not enabled()):
        return
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    key = (call, traced, op, root, treedef, tuple(map(_leaf_key, leaves)))

    def signature() -> Signature:
        where = "inside jax.jit" if traced else "outside jax.jit"
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        described = [(jax.tree_util.keystr(p), leaf_kind(x)) for p, x in flat]
        return (call, where, op, root, described)

    agree(comm, key, signature, what=what, traced=traced)


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


# Requests given up on at their deadline, kept with their buffers: MPI may still write into
# them if the missing ranks arrive later, so they must never be freed.
_abandoned: list[Any] = []


def _exchange(comm: Any, digest: int, timeout: float | None, what: str) -> bool:
    """Whether every rank of ``comm`` has this digest: one ``Iallreduce`` of two int64,
    waited for (``timeout`` None) or given up on after ``timeout`` seconds (TimeoutError)."""
    MPI = _mpi()
    buffer = np.array([digest, -digest], np.int64)
    request = comm.Iallreduce(MPI.IN_PLACE, buffer, MPI.MAX)
    if timeout is None:
        request.Wait()
    else:
        deadline = time.monotonic() + timeout
        pause = 1e-5
        while not request.Test():
            if time.monotonic() > deadline:
                _abandoned.append((request, buffer))
                msg = (
                    f"Rank {comm.Get_rank()} waited {timeout:g} s in jaxddp's check of the "
                    f"{what} and not every rank arrived: some rank is running different code "
                    "(another branch, a loop that ended early, a step compiled again on some "
                    f"ranks only). Raise the wait with {TIMEOUT_VARIABLE}=<seconds> if the "
                    "ranks are just slow."
                )
                raise TimeoutError(msg)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
    return int(buffer[0]) == -int(buffer[1])


def mismatch_message(everyone: list[Signature], what: str) -> str:
    """The first field in which the ranks' signatures differ, with each rank's value."""
    fix = (
        " Every rank must call the same collectives in the same order with the same "
        "arguments, or MPI combines bytes that do not belong together or waits forever."
    )
    for index, name in ((0, "the collective"), (1, "where it runs"), (2, "`op`"), (3, "`root`")):
        values = [s[index] for s in everyone]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            return (
                f"The ranks called different collectives ({what}): {name} differs "
                f"({per_rank})." + fix
            )
    return explain([s[4] for s in everyone], what)


def agree(
    comm: Any,
    key: Any,
    signature: Callable[[], Signature],
    *,
    what: str,
    traced: bool,
) -> None:
    """Makes every rank of ``comm`` agree on a collective's signature before it sends data.

    ``key`` (hashable on this rank) caches the digest of ``signature()``. Raises
    :class:`TreeMismatchError` on every rank when the signatures differ; inside ``jax.jit``
    (``traced``), TimeoutError when some rank does not arrive within ``JAXDDP_CHECK_TIMEOUT``
    seconds. A collective over ``comm``: every rank of it must call it.
    """
    digest, mine = _cached(key, signature)
    timeout = _settings.check_timeout() if traced else None
    if _exchange(comm, digest, timeout, what):
        return
    everyone = comm.allgather(mine)
    raise TreeMismatchError(mismatch_message(everyone, what))
