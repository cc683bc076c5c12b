"""The chain of one jit's collectives: where a collective is staged into a jaxpr, the form it
takes (chained at the jit's own level, ordered inside control flow and nested jits) and the
token that orders it after the one staged before it."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core.primitives import create_token_p

from . import compat
from .forms import bridge_p, chained_p, ordered_p
from .path import fast_path

__all__ = ["chain_of", "close_chain", "stage"]


class _Chain:
    """What one jit's trace has staged: the last chained token, and whether a collective
    inside control flow (or a nested jit) has switched the rest to the ordered form."""

    __slots__ = ("switched", "token")

    def __init__(self) -> None:
        self.token: Any = None
        self.switched = False


_chains: weakref.WeakKeyDictionary[Any, _Chain] = weakref.WeakKeyDictionary()


def chain_of(trace: Any) -> tuple[Any, _Chain]:
    """The jit that ``trace`` belongs to (its outermost jaxpr trace), and its chain."""
    root = compat.outermost_jaxpr_trace(trace)
    chain = _chains.get(root)
    if chain is None:
        chain = _chains.setdefault(root, _Chain())
    return root, chain


def stage(trace: Any, args: Sequence[Any], avals: Any, params: dict[str, Any]) -> list[Any]:
    """Stages a collective into ``trace``: chained at the jit's own level, ordered inside
    control flow and nested jits (and everywhere when the fast path is off).

    The first collective staged below the jit's own level ends the chain (:func:`close_chain`):
    a bridge at the jit's own level continues it into JAX's effect token, and every later
    collective in the jit is ordered too.
    A tangent (a differentiated collective) staged at the jit's own level, as forward mode
    does, joins the chain; one staged deeper (reverse mode's linearized trace, which
    transposes it away) is ordered and leaves the chain alone.
    """
    tangent = params["tangent"]  # params: the collective's, with its `kind` and `tangent`
    root, chain = chain_of(trace)
    if fast_path() and trace is root and not chain.switched:
        token = chain.token
        if token is None:
            _wait_at_exit()
            token = create_token_p.bind_with_trace(root, (), (), {})
        token, *outs = chained_p.bind_with_trace(
            trace,
            (token, *args),
            (compat.abstract_token(), *avals),
            params,
        )
        chain.token = token
        return outs
    if not tangent:
        close_chain(trace)
    return ordered_p.bind_with_trace(trace, tuple(args), tuple(avals), params)


def close_chain(trace: Any) -> None:
    """Ends the chain of the jit that ``trace`` belongs to: a bridge from its last token
    into mpi4jax's ordered effect (:data:`jaxddp._collectives._jax.forms.bridge_p`), staged
    at the jit's own level, and every later collective of that jit ordered."""
    root, chain = chain_of(trace)
    if chain.switched:
        return
    chain.switched = True
    if chain.token is not None:
        bridge_p.bind_with_trace(root, (chain.token,), (compat.abstract_token(),), {})
        chain.token = None


@functools.cache
def _wait_at_exit() -> None:
    """At exit, waits for every dispatched executable before MPI is finalized.

    JAX's effects barrier does not wait for executables without effects. Today the backend's
    own teardown at exit waits for its thread pool anyway (the exit-without-waiting test
    passes without this); this makes the guarantee jaxddp's own. The PjRt CPU client runs
    a device's executables in dispatch order, so a trivial one dispatched last is done only
    when all before it are; mpi4py finalizes MPI after every Python ``atexit`` handler.
    """
    import atexit

    def wait() -> None:
        with contextlib.suppress(Exception):  # the runtime may already be shutting down
            jax.block_until_ready(jax.numpy.zeros(()) + 1)

    atexit.register(wait)
