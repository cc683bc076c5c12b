"""One compiled form of a step of ``jaxddp.spmd``: the step under ``jax.shard_map`` over the
ranks' mesh, for one tree of arguments, each leaf's abstract value and whether it enters
replicated (``P()``) or as this rank's block of a global array (``P(axis)``).

The step is traced once per form, into a jaxpr that is then run in the mapped program: a
result that every rank computes alike (a parameter updated with all-reduced gradients, a
``masked_mean``) leaves replicated, a global array every rank holds whole and the next call
takes as it is; a result that varies (a per-rank loss) leaves as this rank's block. Which is
which is read from that jaxpr (:mod:`.varying`), so the results' specs are filled in while
the step is traced (``shard_map`` reads them once the step has returned).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import PartitionSpec

from ..._collectives import signature as _signature
from ..._collectives._jax import compat as _compat
from ..._collectives._jax import xla as _xla
from ..._collectives.api import channels
from . import agree as _agree
from . import nnx_slots as _slots
from . import varying as _varying

__all__ = ["Form", "Layout", "Leaf"]

AXIS = _xla.AXIS
REPLICATED = PartitionSpec()
BLOCKED = PartitionSpec(AXIS)


class Layout(NamedTuple):
    """What a form is compiled for besides its leaves: the static arguments (position,
    value), the arguments' tree, how many positional arguments the step takes, and the
    graph of its NNX objects (None without)."""

    statics: tuple[tuple[int, Any], ...]
    treedef: Any
    count: int
    graphdef: Any


class Leaf:
    """How one argument leaf enters a form: ``replicated`` or as this rank's block, its
    shape and dtype, and whether it is weakly typed (a Python number)."""

    __slots__ = ("aval", "dtype", "ndim", "replicated", "shape", "weak")

    def __init__(self, replicated: bool, shape: tuple[int, ...], dtype: str, weak: bool) -> None:
        self.replicated, self.shape, self.dtype, self.weak = replicated, shape, dtype, weak
        self.ndim = len(shape)
        self.aval: Any = None  # of its global array (Form.__init__)

    def inside(self, block: Any) -> Any:
        """The step's view of the leaf, from what the mesh hands this rank."""
        x = block.reshape(()) if not self.replicated and self.ndim == 0 else block
        return _compat.weaken(x) if self.weak and not x.weak_type else x


class Form:
    """The compiled step for one form; ``run(*global_arrays)`` returns the results' global
    arrays, flat. After the first run, ``varying`` lists the results that are per-rank
    blocks (``scalar``: whether each was a scalar), ``treedef`` the results' tree, and
    ``slots`` where the step returned one of its NNX objects."""

    def __init__(
        self,
        fun: Callable[..., Any],
        shardings: tuple[Any, Any],
        leaves: tuple[Leaf, ...],
        layout: Layout,
        name: str,
    ) -> None:
        self.fun, self.leaves, self.layout, self.name = fun, leaves, layout, name
        replicated, blocked = shardings
        mesh = replicated.mesh
        self._shardings = tuple(replicated if leaf.replicated else blocked for leaf in leaves)
        for leaf, sharding in zip(leaves, self._shardings, strict=True):
            shape = leaf.shape
            if not leaf.replicated:  # the ranks' blocks stacked, a scalar's as a vector
                shape = (mesh.size * (shape[0] if shape else 1), *shape[1:])
            leaf.aval = _compat.sharded_aval(shape, leaf.dtype, leaf.weak, sharding)
        self.varying: tuple[int, ...] = ()
        self.scalar: tuple[bool, ...] = ()
        self.treedef: Any = None
        self.out_specs: list[PartitionSpec] = []  # filled while the step is traced
        in_specs = tuple(REPLICATED if leaf.replicated else BLOCKED for leaf in leaves)
        mapped = jax.shard_map(
            self._body, mesh=mesh, in_specs=in_specs, out_specs=self.out_specs, check_vma=False
        )
        self.run = jax.jit(mapped)

    def _step(self, *views: Any) -> list[Any]:
        """The user's step on this rank's views of the arguments: its results and its NNX
        objects' new state, flat (the tree in ``self.treedef``)."""
        statics, treedef, count, graphdef = self.layout
        tree = jax.tree_util.tree_unflatten(treedef, list(views))
        dynamic, kwargs = tree["args"], tree["kwargs"]
        objects: tuple[Any, ...] = ()
        if graphdef is not None:
            objects, dynamic, kwargs = _slots.merge(graphdef, tree["nnx_state"], dynamic, kwargs)
        fixed = dict(statics)
        rest = iter(dynamic)
        args = [fixed[i] if i in fixed else next(rest) for i in range(count)]
        with _xla.bound(AXIS):
            out = self.fun(*args, **kwargs)
        _end_of_trace(self.name)
        out = _slots.mark(out, objects)  # the step's own NNX objects: their places
        new_state = _slots.state(objects) if graphdef is not None else None
        results = jax.tree_util.tree_map(jnp.asarray, (out, new_state))
        flat, self.treedef = jax.tree_util.tree_flatten(results)
        return flat

    def _body(self, *blocks: Any) -> list[Any]:
        views = [leaf.inside(b) for leaf, b in zip(self.leaves, blocks, strict=True)]
        with _xla.bound(AXIS):  # the step's collectives name the axis while it is traced
            closed = jax.make_jaxpr(self._step)(*views)
        flat = _compat.eval_jaxpr(closed.jaxpr, closed.consts, *views)
        varies = _varying.varying_outputs(
            closed.jaxpr,
            [not leaf.replicated for leaf in self.leaves],
            _consts_differ(closed.consts),
            AXIS,
        )
        specs, outs, varying, scalar = [], [], [], []
        for i, (x, per_rank) in enumerate(zip(flat, varies, strict=True)):
            if per_rank:
                varying.append(i)
                scalar.append(x.ndim == 0)
                specs.append(BLOCKED)
                outs.append(x.reshape(1) if x.ndim == 0 else x)
            else:
                specs.append(REPLICATED)
                outs.append(x)
        self.out_specs[:] = specs
        self.varying, self.scalar = tuple(varying), tuple(scalar)
        return outs

    def make(self, i: int, x: Any) -> Any:
        """Argument ``i``'s global array from this rank's value ``x``, on its device: its
        block as it is (a scalar's as a vector of one)."""
        leaf = self.leaves[i]
        if leaf.ndim == 0 and not leaf.replicated:
            x = x.reshape(1)
        return _compat.global_array(leaf.aval, self._shardings[i], x)

    def results(self, flat: list[Any]) -> Any:
        """The results' tree from the global arrays ``run`` returned: replicated arrays as
        they are, each per-rank one as this rank's block, shaped as the step returned it."""
        for i, scalar in zip(self.varying, self.scalar, strict=True):
            block = flat[i].addressable_data(0)
            flat[i] = block.reshape(()) if scalar else block
        return jax.tree_util.tree_unflatten(self.treedef, flat)


def _consts_differ(consts: list[Any]) -> list[bool]:
    """Whether each constant of the step's program (an array its code closed over) differs
    between the ranks: a traced one may; a concrete one is compared, once per form."""
    flags = [isinstance(c, Tracer) for c in consts]
    concrete = [i for i, c in enumerate(consts) if not flags[i]]
    _, size, _, host_comm = channels(None)
    if size == 1 or not concrete:
        return flags
    prints = [_agree.fingerprint(consts[i]) for i in concrete]
    rows = _agree.agree(
        host_comm, 0, prints, lambda: ("", None, None, []), always=True,
        what="constants of a step wrapped in `jaxddp.spmd`", call="a step of `jaxddp.spmd`",
    )  # fmt: skip
    assert rows is not None
    for i, alike in zip(concrete, (rows == rows[0]).all(axis=0).tolist(), strict=True):
        flags[i] = not alike
    return flags


def _end_of_trace(name: str) -> None:
    """The ranks agree that their steps' traces end here: where one rank's step calls a
    collective more (a branch on the rank), that collective's check meets this one on the
    other ranks, and every rank raises TreeMismatchError instead of waiting in the step."""
    _, size, _, host_comm = channels(None)
    if size == 1 or not _signature.enabled():
        return
    _signature.agree(
        host_comm,
        ("jaxddp.spmd", "end"),
        lambda: ("the end of the step wrapped in `jaxddp.spmd`", None, None, []),
        what=f"collectives of the step `{name}` wrapped in `jaxddp.spmd`",
        traced=True,
    )
