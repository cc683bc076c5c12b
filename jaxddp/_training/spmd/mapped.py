"""A step of ``jaxddp.spmd`` on the XLA path: each call's arguments as global arrays over the
ranks' mesh, the compiled form for them, and the results back.

What a call returns replicated (the parameters, the optimizer state, an NNX model's state
after an all-reduced update) is a global array every rank holds whole: the next call takes
it as it is, so state fed back costs no Python work per leaf beyond reading its abstract
value and sharding (jit's own dispatch does the rest, in C++). New values are made global
once, in one pass: a value equal on every rank (a Python number, a model's first
parameters) replicated, any other (a batch) as this rank's block. Where a new value once
differed across the ranks, that place of that form holds per-rank values from then on and
is no longer compared (a batch is compared once, not at every step).

Nothing grows with the number of calls: the forms, and what each learnt, are kept for the
:data:`FORMS` most recent trees of arguments, and nothing refers to a call's arguments or
results once it has returned.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding

from ..._base import progress as _progress
from ..._collectives import signature as _signature
from ..._collectives._jax import xla as _xla
from ..._collectives.api import channels
from ..._runtime import distributed as _distributed
from . import agree as _agree
from . import nnx_slots as _slots
from .form import BLOCKED, REPLICATED, Form, Layout, Leaf

__all__ = ["FORMS", "Mapped"]

FORMS = 32  # trees of arguments (with their shapes and dtypes) remembered per wrapped step

_WHAT = "tree of arguments of the step wrapped in `jaxddp.spmd`"
_NUMBERS = (bool, int, float, complex)
_OURS, _NEW, _NUMBER = 0, 1, 2  # how a leaf arrives


class _Tree:
    """What one tree of arguments (with its leaves' abstract values) has taught: its
    digest for the ranks' check, the places found to hold per-rank values, its forms."""

    __slots__ = ("asked", "digest", "empty", "forms", "kinds", "new", "per_rank", "values")

    def __init__(self, digest: int, kinds: tuple[int, ...], values: tuple[Any, ...]) -> None:
        self.digest = digest
        self.kinds = kinds
        self.values = values  # each leaf's (shape, dtype, weak type), however it came
        self.empty = not any(np.prod(shape, dtype=int) for shape, _, _ in values)
        self.new = [i for i, kind in enumerate(kinds) if kind != _OURS]
        self.per_rank: set[int] = set()
        self.asked = self.unknown()
        self.forms: dict[tuple[int, ...], Form] = {}

    def unknown(self) -> list[int]:
        """The new values whose sameness across the ranks is not known: fingerprinted."""
        return [i for i in self.new if self.kinds[i] == _NUMBER or i not in self.per_rank]


class Mapped:
    """The wrapped step on the XLA path."""

    def __init__(self, fun: Callable[..., Any], statics: tuple[int, ...]) -> None:
        self.fun = fun
        self.statics = statics
        functools.update_wrapper(self, fun)
        self.name = getattr(fun, "__name__", type(fun).__name__)
        self.call = f"the step `{self.name}` wrapped in `jaxddp.spmd`"
        self._trees: collections.OrderedDict[Any, _Tree] = collections.OrderedDict()
        # the compiled forms, shared by the trees that differ only in how their leaves came
        # (a first call's new parameters, the next call's replicated results)
        self._forms: collections.OrderedDict[Any, Form] = collections.OrderedDict()
        self._holds: collections.OrderedDict[Any, bool] = collections.OrderedDict()
        self._replicated: Any = None
        self._device: Any = None
        self._mine: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _progress.note("a step of jaxddp.spmd")
        statics = tuple((i, args[i]) for i in self.statics)
        dynamic = [a for i, a in enumerate(args) if i not in self.statics]
        tree: dict[str, Any] = {"args": dynamic, "kwargs": kwargs, "nnx_state": None}
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        objects, graphdef = (), None
        if self._holds_objects(treedef, dynamic, kwargs):  # Flax NNX objects: their state
            objects, graphdef, nnx_state, (dynamic, kwargs) = _slots.split((dynamic, kwargs))
            tree = {"args": dynamic, "kwargs": kwargs, "nnx_state": nnx_state}
            leaves, treedef = jax.tree_util.tree_flatten(tree)
        if self._replicated is None:
            mesh = _distributed.mesh()
            self._replicated = NamedSharding(mesh, REPLICATED)
            self._blocked = NamedSharding(mesh, BLOCKED)
            self._device = mesh.devices.flat[jax.process_index()]
            # this rank's device's sharding, as its arrays carry it (jax 0.12.1 deprecates
            # naming the class); made eagerly even when the first call is traced, which is
            # refused below
            with jax.ensure_compile_time_eval():
                self._mine = jax.device_put(0, self._device).sharding
        kinds, avals = self._read(leaves)
        if kinds is None:  # traced values
            if _xla.axis() is not None:  # inside another spmd step: already mapped
                return self.fun(*args, **kwargs)
            msg = (
                "jaxddp.spmd must be the outermost transformation: its step was called with "
                "traced values (inside jax.jit, jax.grad or jax.vmap). Put those inside the "
                "step, and call the wrapped step with arrays."
            )
            raise TypeError(msg)
        layout = Layout(statics, treedef, len(args), graphdef)
        key = (layout, kinds, avals)
        known = self._trees.get(key)
        fresh = known is None
        if known is None:
            known = self._remember(key, tree, leaves, kinds)
        else:
            self._trees.move_to_end(key)
        if known.empty:  # no rank holds data: nothing to map
            return jax.jit(self.fun, static_argnums=self.statics)(*args, **kwargs)
        replicated = self._decide(known, leaves, lambda: _signature_of(tree, kinds), fresh)
        choice = tuple(sorted(replicated))
        form = known.forms.get(choice)
        if form is None:
            form = known.forms[choice] = self._form(layout, known, kinds, replicated)
        blocks = list(leaves)
        device, mine, make = self._device, self._mine, form.make
        for i in known.new:  # the values not yet global: made so, in one pass
            x = blocks[i]
            if not (isinstance(x, jax.Array) and x.committed and x.sharding == mine):
                x = jax.device_put(x, device)
            blocks[i] = make(i, x)
        out = form.results(form.run(*blocks))
        out, new_state = out
        if objects:
            from flax import nnx

            nnx.update(objects, new_state)
        return _slots.restore(out, objects)

    def _holds_objects(self, treedef: Any, dynamic: Any, kwargs: Any) -> bool:
        """Whether the arguments hold Flax NNX objects: looked for once per tree (NNX objects
        are pytrees, so the tree they make says that they are there)."""
        try:
            holds = self._holds.get(treedef)
        except TypeError:  # a node whose auxiliary data cannot be hashed
            return _slots.holds_objects((dynamic, kwargs))
        if holds is None:
            holds = _slots.holds_objects((dynamic, kwargs))
            _put(self._holds, treedef, holds)
        return holds

    def _decide(
        self, known: _Tree, leaves: list[Any], signature: Callable[[], Any], fresh: bool
    ) -> set[int]:
        """The ranks' check of the call (the form's digest), and which of the new values
        enter replicated: those equal on every rank (a batch that differs is per-rank from
        then on, at that place of that form, and no longer compared)."""
        asked = known.asked
        _, size, _, host_comm = channels(None)
        if size == 1:
            return set(asked)
        rows = _agree.agree(
            host_comm,
            known.digest,
            [_agree.fingerprint(leaves[i]) for i in asked],
            signature,
            always=fresh or _signature.enabled(),
            what=_WHAT,
            call=self.call,
        )
        if rows is None:
            return set()
        replicated = set()
        for i, alike in zip(asked, (rows == rows[0]).all(axis=0).tolist(), strict=True):
            if alike:
                replicated.add(i)
            elif known.kinds[i] == _NEW:
                known.per_rank.add(i)  # a batch: per-rank from now on
        known.asked = known.unknown()
        return replicated

    def _read(self, leaves: list[Any]) -> tuple[Any, Any]:
        """Each leaf's kind and abstract value (None, None: a traced value among them)."""
        kinds, avals = [], []
        replicated = self._replicated
        for x in leaves:
            sharding = getattr(x, "sharding", None)
            if sharding is replicated or (
                isinstance(sharding, NamedSharding) and sharding == replicated
            ):
                kinds.append(_OURS)
                avals.append(x.aval)
            elif type(x) in _NUMBERS:
                kinds.append(_NUMBER)
                avals.append(type(x))
            elif isinstance(x, Tracer):
                return None, None
            else:
                kinds.append(_NEW)
                dtype = getattr(x, "dtype", None)
                avals.append((np.shape(x), np.dtype(dtype) if dtype is not None else type(x),
                              bool(getattr(x, "weak_type", False))))  # fmt: skip
        return tuple(kinds), tuple(avals)

    def _remember(self, key: Any, tree: Any, leaves: list[Any], kinds: Any) -> _Tree:
        values = tuple(
            (
                np.shape(x),
                jax.dtypes.canonicalize_dtype(type(x) if kind == _NUMBER else x.dtype).name,
                kind == _NUMBER or bool(getattr(x, "weak_type", False)),
            )
            for x, kind in zip(leaves, kinds, strict=True)
        )
        known = _Tree(_agree.digest(_signature_of(tree, kinds)), kinds, values)
        _put(self._trees, key, known)
        return known

    def _form(self, layout: Layout, known: _Tree, kinds: Any, replicated: set[int]) -> Form:
        spec = tuple(
            (kind == _OURS or i in replicated, *value)
            for i, (kind, value) in enumerate(zip(kinds, known.values, strict=True))
        )
        key = (layout, spec)
        form = self._forms.get(key)
        if form is None:
            leaves = tuple(Leaf(rep, shape, dtype, weak) for rep, shape, dtype, weak in spec)
            form = Form(self.fun, (self._replicated, self._blocked), leaves, layout, self.name)
            _put(self._forms, key, form)
        return form


def _put(cache: collections.OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """``cache[key] = value``, the oldest entries dropped past :data:`FORMS`."""
    cache[key] = value
    while len(cache) > FORMS:
        cache.popitem(last=False)


def _signature_of(tree: Any, kinds: tuple[int, ...]) -> _signature.Signature:
    """What each rank passed, path by path, for the message that names a difference."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    described = []
    for (path, leaf), kind in zip(flat, kinds, strict=True):
        what = _signature.leaf_kind(leaf)
        if getattr(leaf, "weak_type", False):
            what = f"{what} (weakly typed)"
        if kind == _OURS:
            what = f"{what} (a replicated result of a step)"
        described.append((jax.tree_util.keystr(path), what))
    return ("jaxddp.spmd", None, None, described)
