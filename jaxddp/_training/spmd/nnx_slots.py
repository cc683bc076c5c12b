"""Flax NNX objects among a step's arguments, as ``nnx.jit`` treats them: their state travels
through the step, a slot marks where each stood (in the arguments, and in the results where
the step returns one of them), and afterwards they are updated in place and returned as
themselves."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["Slot", "holds_objects", "is_graph_node", "mark", "merge", "restore", "split", "state"]


@functools.cache
def _graph_node_test() -> Callable[[Any], bool]:
    try:
        from flax.nnx import graph
    except ImportError:  # no flax: no NNX objects
        return lambda x: False
    return graph.is_graph_node


def is_graph_node(x: Any) -> bool:
    return _graph_node_test()(x)


class Slot:
    """Where the ``k``-th NNX object stood: a pytree node of no leaves."""

    def __init__(self, k: int) -> None:
        self.k = k


jax.tree_util.register_pytree_node(Slot, lambda s: ((), s.k), lambda k, _: Slot(k))


def _is_slot(x: Any) -> bool:
    return isinstance(x, Slot)


def holds_objects(tree: Any) -> bool:
    """Whether NNX objects stand anywhere in ``tree``."""
    flat = jax.tree_util.tree_leaves(tree, is_leaf=is_graph_node)
    return any(is_graph_node(x) for x in flat)


def split(tree: Any) -> tuple[tuple[Any, ...], Any, Any, Any]:
    """``(objects, graphdef, state, tree)``: the NNX objects of ``tree`` wherever they stand
    (positional, keyword, in a container), their graph and state, and ``tree`` with a slot in
    each one's place. Without NNX objects: ``((), None, None, tree)``."""
    flat, outer = jax.tree_util.tree_flatten(tree, is_leaf=is_graph_node)
    objects = tuple(x for x in flat if is_graph_node(x))
    if not objects:
        return (), None, None, tree
    from flax import nnx

    graphdef, nnx_state = nnx.split(objects)
    slots = iter(range(len(objects)))
    flat = [Slot(next(slots)) if is_graph_node(x) else x for x in flat]
    return objects, graphdef, nnx_state, jax.tree_util.tree_unflatten(outer, flat)


def merge(graphdef: Any, nnx_state: Any, *trees: Any) -> tuple[Any, ...]:
    """Inside the step: the objects made again from their state, and ``trees`` with each slot
    replaced by its object."""
    from flax import nnx

    objects = nnx.merge(graphdef, nnx_state)
    filled = jax.tree_util.tree_map(
        lambda x: objects[x.k] if _is_slot(x) else x, trees, is_leaf=_is_slot
    )
    return (objects, *filled)


def state(objects: tuple[Any, ...]) -> Any:
    from flax import nnx

    return nnx.state(objects)


def mark(out: Any, objects: tuple[Any, ...]) -> Any:
    """The step's results with each of its own NNX objects (the ones made from its
    arguments) replaced by its slot: the caller gets back the object it passed, as from
    ``nnx.jit``."""
    if not objects:
        return out
    flat, outer = jax.tree_util.tree_flatten(out, is_leaf=is_graph_node)
    places = {id(o): k for k, o in enumerate(objects)}
    flat = [Slot(places[id(x)]) if is_graph_node(x) and id(x) in places else x for x in flat]
    return jax.tree_util.tree_unflatten(outer, flat)


def restore(out: Any, objects: tuple[Any, ...]) -> Any:
    """The results with each slot replaced by the caller's own object."""
    if not objects:
        return out
    return jax.tree_util.tree_map(
        lambda x: objects[x.k] if _is_slot(x) else x, out, is_leaf=_is_slot
    )
