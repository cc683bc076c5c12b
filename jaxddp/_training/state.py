"""Model state other than parameters, kept identical across ranks.

The gradient sync keeps the parameters identical; state that a forward pass updates on its
own (batch norm's running mean and variance, NNX ``nnx.BatchStat``, linen's
``batch_stats``) is computed from each rank's shard and drifts apart, so that every rank
would evaluate (and save) a different model. :func:`average_state` averages it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._collectives.api import allreduce, restore_kind
from .._collectives.dtypes import is_key_dtype
from .._types import Communicator, PyTree

__all__ = ["average_state"]


def _floating(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or is_key_dtype(dtype):
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def average_state(tree: PyTree, *, comm: Communicator | None = None) -> Any:
    """Every floating-point leaf of ``tree`` replaced by its mean over the ranks.

    For the state a forward pass updates besides the parameters: batch norm statistics
    (``nnx.state(model, nnx.BatchStat)``, linen's ``variables["batch_stats"]``) and the
    like. Running averages are linear in the batch statistics, so averaging them over the
    ranks, at every step or only before evaluating or saving, gives the same result: the
    running average of the ranks' mean statistics. Other leaves (integers, booleans, PRNG
    keys, non-arrays) pass unchanged; use :func:`jaxddp.synchronize` to give every rank
    root's copy of those. Usable inside ``jax.jit`` (one allreduce, small leaves packed) and
    outside it; jax arrays stay jax arrays. Every rank must call it.

    Args:
      tree: any pytree, e.g. an ``nnx.State`` or a dict of batch statistics.
      comm: an mpi4py communicator to average over; by default the whole world.

    Returns:
      A tree of the same structure, identical on every rank in its floating-point leaves.

    Example:
      >>> import jax.numpy as jnp, jaxddp
      >>> stats = {"mean": jnp.ones(3), "count": 7}
      >>> out = jaxddp.average_state(stats)  # on a world of one: unchanged values
      >>> out["mean"].tolist(), out["count"]
      ([1.0, 1.0, 1.0], 7)
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    picked = [i for i, leaf in enumerate(leaves) if _floating(leaf)]
    if not picked:
        return tree
    values = [leaves[i] for i in picked]
    averaged = allreduce(values, op="mean", comm=comm)
    for i, new in zip(picked, averaged, strict=True):
        leaves[i] = restore_kind(leaves[i], new)  # jax arrays stay jax arrays
    return jax.tree_util.tree_unflatten(treedef, leaves)
