"""``jaxddp.spmd``: a per-rank step, run with JAX's own collectives when ``JAXDDP_COLLECTIVES=xla``.

The user's step stays a per-rank function: its arguments are this rank's values (the model,
the optimizer state, this rank's batch), jaxddp's collectives inside it reduce across the
ranks, and it returns this rank's results. With ``JAXDDP_COLLECTIVES=mpi`` (the default)
:func:`spmd` is ``jax.jit`` (or the step itself, when it is jitted already). With ``xla``, each
call makes every argument leaf one block of a global array over the ranks' mesh (one device
per rank, :func:`jaxddp._runtime.distributed.mesh`; no copy: the rank's own buffer is its
block), runs the step under ``jax.shard_map`` with jaxddp's collectives bound to the mesh
axis (``psum``, ``all_gather``, ``all_to_all``: NCCL on GPUs, gloo on CPUs), and gives back
each result's block on this rank. Flax NNX objects among the arguments (a model, an
``nnx.Optimizer``) travel as their state and are updated in place, as ``nnx.jit`` does.

Before each call the ranks agree on the arguments' tree, shapes and dtypes (one small MPI
message, ``JAXDDP_CHECK``): ranks whose batches differ in shape would otherwise build
global arrays that do not fit together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from .._base import progress as _progress
from .._base import settings as _settings
from .._collectives import signature as _signature
from .._collectives._jax import compat as _compat
from .._collectives._jax import xla as _xla
from .._collectives.api import channels
from .._runtime import distributed as _distributed

__all__ = ["spmd"]

_WHAT = "tree of arguments of the step wrapped in `jaxddp.spmd`"


def spmd(fun: Callable[..., Any] | None = None, *, static_argnums: int | Sequence[int] = ()) -> Any:
    """Runs a per-rank training step with the collectives ``JAXDDP_COLLECTIVES`` picks.

    Write the step as for one rank (``jaxddp.masked_mean`` loss,
    ``optax.chain(jaxddp.allreduce_gradients(), ...)``, ``SyncBatchNorm``, a sharded
    optimizer) and wrap it once: ``step = jaxddp.spmd(train_step)``, or use it as a
    decorator. With ``mpi`` (the default) it is ``jax.jit`` (a step already made with
    ``jax.jit`` or ``nnx.jit`` is returned as it is). With ``xla`` every rank runs the step
    over a one-axis mesh of the ranks' devices, and jaxddp's collectives in it are JAX's own
    (NCCL on GPUs); the results equal the MPI path's. See the XLA collectives page.

    Args:
      fun: the step: arrays, pytrees of arrays and Flax NNX objects in (an NNX object, a
        positional argument, is updated in place, as with ``nnx.jit``), a pytree of arrays
        out. It may be jitted.
      static_argnums: arguments that are not arrays (a flag, a size): hashable, part of
        what the step is compiled for.

    Returns:
      The wrapped step: called with this rank's values, it returns this rank's results.
      Every rank must call it, with arguments of the same tree, shapes and dtypes;
      otherwise every rank raises :class:`jaxddp.TreeMismatchError` naming the first
      difference (``JAXDDP_CHECK=0`` turns that check off).

    Example:
      >>> import jax.numpy as jnp, jaxddp
      >>> step = jaxddp.spmd(lambda x: jaxddp.allreduce(x, op="sum"))
      >>> float(step(jnp.float32(1.0))) == jaxddp.world_size()
      True
    """
    if fun is None:
        return functools.partial(spmd, static_argnums=static_argnums)
    statics = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    if _settings.collectives() != "xla":
        return fun if hasattr(fun, "lower") else jax.jit(fun, static_argnums=statics)
    return _Mapped(fun, statics)


@functools.cache
def _is_graph_node() -> Callable[[Any], bool]:
    try:
        from flax.nnx import graph
    except ImportError:  # no flax: no NNX objects
        return lambda x: False
    return graph.is_graph_node


class _Slot:
    """Where the ``k``-th NNX object stood in the arguments: a pytree node of no leaves."""

    def __init__(self, k: int) -> None:
        self.k = k


jax.tree_util.register_pytree_node(_Slot, lambda s: ((), s.k), lambda k, _: _Slot(k))


def _is_slot(x: Any) -> bool:
    return isinstance(x, _Slot)


_WEAK = (bool, int, float, complex)  # Python numbers: weakly typed under jit, here too


class _Mapped:
    """A step mapped over the ranks' mesh; its compiled forms are jit's to cache."""

    def __init__(self, fun: Callable[..., Any], statics: tuple[int, ...]) -> None:
        self.fun = fun
        self.statics = statics
        functools.update_wrapper(self, fun)
        self._run = jax.jit(self._mapped, static_argnums=0)
        self._scalars: dict[Any, list[bool]] = {}  # per compiled form: the scalar results
        self._sharding: Any = None
        self._made: dict[int, tuple[Any, Any]] = {}  # the last results: id -> (mine, global)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _progress.note("a step of jaxddp.spmd")
        statics = tuple((i, args[i]) for i in self.statics)
        dynamic = [a for i, a in enumerate(args) if i not in self.statics]
        # NNX objects wherever they stand (positional, keyword, in a container): their state
        # travels, a slot marks their place, and they are updated in place afterwards
        flat, outer = jax.tree_util.tree_flatten((dynamic, kwargs), is_leaf=_is_graph_node())
        objects = tuple(x for x in flat if _is_graph_node()(x))
        graphdef, state = None, None
        if objects:
            from flax import nnx

            graphdef, state = nnx.split(objects)
            slots = iter(range(len(objects)))
            flat = [_Slot(next(slots)) if _is_graph_node()(x) else x for x in flat]
            dynamic, kwargs = jax.tree_util.tree_unflatten(outer, flat)
        tree = {"args": dynamic, "kwargs": kwargs, "nnx_state": state}  # paths name a difference
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if any(isinstance(x, Tracer) for x in leaves):
            if _xla.axis() is not None:  # inside another spmd step: already mapped
                return self.fun(*args, **kwargs)
            msg = (
                "jaxddp.spmd must be the outermost transformation: its step was called with "
                "traced values (inside jax.jit, jax.grad or jax.vmap). Put those inside the "
                "step, and call the wrapped step with arrays."
            )
            raise TypeError(msg)
        _, size, _, host_comm = channels(None)
        if size > 1:
            _signature.check_call(
                host_comm, "jaxddp.spmd", what=_WHAT, traced=False, tree=tree,
                flat=(leaves, treedef),
            )  # fmt: skip
        if all(np.size(x) == 0 for x in leaves):  # no rank holds data: nothing to map
            return jax.jit(self.fun, static_argnums=self.statics)(*args, **kwargs)
        if self._sharding is None:
            mesh = _distributed.mesh()
            self._sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(_xla.AXIS))
        made = self._made
        blocks = [_block(x, made, self._sharding, size) for x in leaves]
        kinds = tuple([(np.ndim(x), type(x) in _WEAK) for x in leaves])
        layout = (statics, treedef, kinds, len(args), graphdef)
        results = self._run(layout, *blocks)
        avals = tuple([(b.shape, b.dtype) for b in blocks])
        scalars = self._scalars[(layout, avals)]
        flat, out_treedef = jax.tree_util.tree_flatten(results)
        mine = [_local(g, scalar) for g, scalar in zip(flat, scalars, strict=True)]
        # the next call's arguments are mostly these results (the state, fed back): their
        # global arrays are taken as they are, instead of being made again
        self._made = {id(x): (x, g) for x, g in zip(mine, flat, strict=True)}
        out, new_state = jax.tree_util.tree_unflatten(out_treedef, mine)
        if objects:
            from flax import nnx

            nnx.update(objects, new_state)
        return out

    def _mapped(self, layout: Any, *blocks: Any) -> Any:
        statics, treedef, kinds, count, graphdef = layout
        mesh = _distributed.mesh()
        spec = jax.sharding.PartitionSpec(_xla.AXIS)
        avals = tuple([(b.shape, b.dtype) for b in blocks])

        def body(*blocks: Any) -> Any:
            leaves = [
                _compat.weaken(b.reshape(()) if rank == 0 else b) if weak else
                (b.reshape(()) if rank == 0 else b)
                for b, (rank, weak) in zip(blocks, kinds, strict=True)
            ]  # fmt: skip
            tree = jax.tree_util.tree_unflatten(treedef, leaves)
            objects: tuple[Any, ...] = ()
            dynamic, kwargs = tree["args"], tree["kwargs"]
            if graphdef is not None:
                from flax import nnx

                objects = nnx.merge(graphdef, tree["nnx_state"])
                dynamic, kwargs = jax.tree_util.tree_map(
                    lambda x: objects[x.k] if _is_slot(x) else x,
                    (dynamic, kwargs),
                    is_leaf=_is_slot,
                )
            fixed = dict(statics)
            rest = iter(dynamic)
            args = [fixed[i] if i in fixed else next(rest) for i in range(count)]
            with _xla.bound(_xla.AXIS):
                out = self.fun(*args, **kwargs)
            _end_of_trace()
            new_state = None
            if graphdef is not None:
                from flax import nnx

                new_state = nnx.state(objects)
            results = jax.tree_util.tree_map(jnp.asarray, (out, new_state))
            self._scalars[(layout, avals)] = [x.ndim == 0 for x in jax.tree.leaves(results)]
            return jax.tree_util.tree_map(_as_block, results)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        return mapped(*blocks)


def _end_of_trace() -> None:
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
        what="collectives of the step wrapped in `jaxddp.spmd`",
        traced=True,
    )


def _block(x: Any, made: dict[int, tuple[Any, Any]], sharding: Any, size: int) -> Any:
    """This rank's leaf as its block of a global array: stacked along its first axis (a
    scalar becomes one element of a vector), its buffer used as it is. A result of the last
    call (``made``) comes with its global array already."""
    found = made.get(id(x))
    if found is not None and found[0] is x and not x.is_deleted():
        return found[1]
    device = sharding.mesh.devices.flat[jax.process_index()]
    if not (isinstance(x, jax.Array) and x.committed and x.devices() == {device}):
        x = jax.device_put(x, device)
    if x.ndim == 0:
        x = x.reshape(1)
    shape = (size * x.shape[0], *x.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, sharding, [x])


def _as_block(x: Any) -> Any:
    return x.reshape(1) if x.ndim == 0 else x


def _local(x: Any, scalar: bool) -> Any:
    """This rank's block of a result, shaped as the step returned it."""
    block = x.addressable_data(0)
    return block.reshape(()) if scalar else block
