"""Do all ranks hold trees of the same shape? An error in seconds instead of a deadlock.

Ranks that pass trees of different structure, shapes or dtypes to a collective call
different MPI operations and wait for each other forever. :func:`check_same_tree` compares
a digest of every rank's tree (paths, shapes, dtypes: never values) and, on a difference,
raises :class:`TreeMismatchError` on every rank naming the first differing path.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import jax
import numpy as np

from . import _comm

__all__ = ["TreeMismatchError", "check_same_tree", "describe_tree", "synchronize"]

TIMEOUT_VARIABLE = "JAXDDP_CHECK_TIMEOUT"
DEFAULT_TIMEOUT = 60.0


class TreeMismatchError(RuntimeError):
    """Ranks passed trees of different structure, shapes or dtypes to a collective."""


def describe_tree(tree: Any) -> list[tuple[str, str]]:
    """``(path, "dtype[shape]")`` for every leaf, in order; ``None`` leaves say ``None``.

    Example:
      >>> import jax.numpy as jnp
      >>> describe_tree({"w": jnp.zeros((2, 3)), "b": None})
      [("['b']", 'None'), ("['w']", 'float32[2,3]')]
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return [(jax.tree_util.keystr(path), _leaf_kind(leaf)) for path, leaf in flat]


def _leaf_kind(leaf: Any) -> str:
    if leaf is None:
        return "None"
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return type(leaf).__name__
    return f"{np.dtype(dtype).name}[{','.join(map(str, shape))}]"


def _explain(descriptions: list[list[tuple[str, str]]], what: str) -> str:
    """The message for ranks whose descriptions differ: the first differing path first."""
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


def _allgather_with_deadline(comm: Any, mine: bytes, timeout: float, what: str) -> list[bytes]:
    """Allgathers a fixed-size byte string; raises if the others do not come in time."""
    size = comm.Get_size()
    send = np.frombuffer(mine, dtype=np.uint8)
    recv = np.empty(size * send.size, dtype=np.uint8)
    request = comm.Iallgather(send, recv)
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not request.Test():
        if time.monotonic() > deadline:
            msg = (
                f"Rank {comm.Get_rank()} waited {timeout:g} s in jaxddp's check of the {what} "
                "and not every rank arrived: some rank is running different code (another "
                "branch, a loop that ended early, a step compiled again on some ranks only). "
                f"Raise the wait with {TIMEOUT_VARIABLE}=<seconds> if the ranks are just slow."
            )
            raise TreeMismatchError(msg)
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return [bytes(chunk) for chunk in recv.reshape(size, send.size)]


def check_same_tree(tree: Any, *, what: str = "tree", timeout: float | None = None) -> None:
    """Raises :class:`TreeMismatchError` on every rank unless all ranks' trees match.

    A collective over jaxddp's private communicator: every rank must call it. It compares
    paths, shapes and dtypes, never values, so it works on tracers at trace time inside
    ``jax.jit`` and costs one small allgather.

    Example:
      >>> import jax.numpy as jnp
      >>> check_same_tree({"w": jnp.zeros(3)})  # passes on a world of one
    """
    if _comm.world_size() == 1:
        return
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_VARIABLE, DEFAULT_TIMEOUT))
    comm = _comm.py_comm()
    description = describe_tree(tree)
    digest = hashlib.sha256(repr(description).encode()).digest()
    digests = _allgather_with_deadline(comm, digest, timeout, what)
    if len(set(digests)) == 1:
        return
    raise TreeMismatchError(_explain(comm.allgather(description), what))


def synchronize(tree: Any, root: int = 0) -> Any:
    """Checks that every rank holds a tree of the same shape, then gives all ``root``'s values.

    Use it once before training, on the parameters and the optimizer state, so every rank
    starts from the same point. Leaves that are not arrays or numbers are returned
    unchanged. Raises :class:`TreeMismatchError` on every rank if the trees differ.

    Example:
      >>> import jax.numpy as jnp, optax, jaxddp
      >>> params = {"w": jnp.ones((2, 2))}
      >>> opt_state = optax.adam(1e-3).init(params)
      >>> params, opt_state = jaxddp.synchronize((params, opt_state))
      >>> params["w"].shape
      (2, 2)
    """
    check_same_tree(tree, what="tree passed to synchronize")
    return _comm.broadcast(tree, root)
