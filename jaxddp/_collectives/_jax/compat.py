"""Every JAX and mpi4jax internal jaxddp uses, and what differs between the versions it was
verified on. This is the only jaxddp module that imports ``jax._src`` or ``mpi4jax._src``; the
others use public JAX (``jax``, ``jax.extend``, ``jax.ffi``, ``jax.interpreters``) or this.

Verified (:data:`VERIFIED`), with mpi4jax 0.9.1.post2 on the fast path, by the ordering tests
(``tests/test_ordering.py``, ``tests/mpi/test_ordering.py``):

* jax/jaxlib 0.12.0.1 (Python 3.13 and 3.12): the whole suite (``nox -s tests``: the MPI
  suite at 2, 3 and 4 ranks, the ordering tests at 2 and 4);
* jax/jaxlib 0.10.2 (Python 3.11): the ordering tests at 2 and 4 ranks;
* jax/jaxlib 0.11.2 (Python 3.12): the ordering tests at 2 ranks.

``nox -s "tests_jax(0.10)"`` (``0.11``, ``0.12``) runs both suites on each.

What differs among them:

* dead-code elimination rules take ``(used_outputs, eqn)`` up to 0.11 and
  ``(used_outputs, live_inputs, eqn)`` from 0.12 (:func:`keep_in_dce` takes either);
* mpi4jax 0.9.1 warns at import on jax 0.12 that it was released for 0.11.2 at most: jaxddp
  verified that pair (this suite), so it silences that warning where it verified the pair
  (:func:`silence_mpi4jax_version_warning`).

Only the fast path (:func:`jaxddp._collectives._jax.path.fast_path`) uses the internals of
JAX's tracing and staging, and only on a verified JAX: they are imported when first needed,
so a JAX that moved one of them still imports jaxddp and takes the ordered path, which uses
only the token's abstract value and mpi4jax's ordered effect.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

import jax
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import mlir

from ..._base.paths import package_of

__all__ = [
    "MPI4JAX_CPU_BRIDGE",
    "VERIFIED",
    "UnverifiedJaxWarning",
    "abstract_token",
    "after_all",
    "apply_primitive",
    "backends_started",
    "equation_frames",
    "eval_jaxpr",
    "global_array",
    "is_jaxpr_trace",
    "jax_versions",
    "jit_staging_rule",
    "keep_in_dce",
    "lowering_into_main",
    "missing_internals",
    "mpi4jax_has_cuda",
    "mpi4jax_stages_through_host",
    "ordered_effect",
    "outermost_jaxpr_trace",
    "replay_context",
    "set_current_trace",
    "set_jit_staging_rule",
    "sharded_aval",
    "silence_mpi4jax_version_warning",
    "unverified_reason",
    "warn_if_unverified",
    "weaken",
]

# (major, minor) of the JAX releases whose fast path the test suite established, and the
# exact jax/jaxlib versions it ran on.
VERIFIED: dict[tuple[int, int], str] = {(0, 10): "0.10.2", (0, 11): "0.11.2", (0, 12): "0.12.0.1"}

# The mpi4jax releases (major, minor) whose internals below were read, and the module of
# its CPU bridge (where its build records the MPI it was compiled against).
VERIFIED_MPI4JAX = frozenset({(0, 9)})
MPI4JAX_CPU_BRIDGE = "mpi4jax._src.xla_bridge.mpi_xla_bridge_cpu"


class UnverifiedJaxWarning(UserWarning):
    """jaxddp runs on a JAX its test suite has not covered: it takes the ordered path."""


def _minor(version: str | None) -> tuple[int, int] | None:
    try:
        major, minor = (version or "").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def jax_versions() -> tuple[str, str | None]:
    """The imported jax's version, and the installed jaxlib's."""
    return jax.__version__, _installed("jaxlib")


def unverified_reason() -> str | None:
    """Why this JAX is outside :data:`VERIFIED` (``None`` when inside)."""
    jax_version, jaxlib_version = jax_versions()
    for name, version in (("jax", jax_version), ("jaxlib", jaxlib_version)):
        if _minor(version) not in VERIFIED:
            verified = ", ".join(f"{a}.{b}" for a, b in sorted(VERIFIED))
            return f"{name} {version} is not among the releases jaxddp was verified on ({verified})"
    return None


@functools.cache
def missing_internals() -> str | None:
    """Whether every JAX internal the fast path uses imports (``None``), or what is missing."""
    try:
        _internals()
    except (ImportError, AttributeError) as exc:
        return f"a JAX internal the fast path uses is missing: {exc}"
    return None


@functools.cache
def _internals() -> Any:
    from types import SimpleNamespace

    from jax._src import dispatch, source_info_util
    from jax._src.core import set_current_trace
    from jax._src.interpreters import partial_eval as pe
    from jax.extend.core.primitives import jit_p

    return SimpleNamespace(
        apply_primitive=dispatch.apply_primitive,
        custom_staging_rules=pe.custom_staging_rules,
        dce_rules=pe.dce_rules,
        jaxpr_trace=pe.DynamicJaxprTrace,
        jit_p=jit_p,
        set_current_trace=set_current_trace,
        source_info_util=source_info_util,
    )


# ----------------------------------------------------------------------- tracing, staging


@functools.cache
def abstract_token() -> Any:
    """The abstract value of an XLA token (what each custom call takes and returns)."""
    from jax._src.core import abstract_token

    return abstract_token


def is_jaxpr_trace(trace: Any) -> bool:
    """Whether ``trace`` stages into a jaxpr (a jit, a loop body, a branch, ...)."""
    return isinstance(trace, _internals().jaxpr_trace)


def outermost_jaxpr_trace(trace: Any) -> Any:
    """The outermost jaxpr trace at or above ``trace``: the jit being traced."""
    root, t = trace, trace
    while t is not None:
        if is_jaxpr_trace(t):
            root = t
        t = getattr(t, "parent_trace", None)
    return root


def keep_in_dce(p: Any) -> None:
    """Dead-code elimination keeps every equation of ``p`` and all its inputs.

    A DCE rule is ``(used_outputs, eqn)`` up to jax 0.11, ``(used_outputs, live_inputs,
    eqn)`` from 0.12: the equation is the last argument in both.
    """
    _internals().dce_rules[p] = lambda *args: ([True] * len(args[-1].invars), args[-1])


def jit_staging_rule() -> Callable[..., Any]:
    """JAX's rule (or whatever is installed now) staging a ``jit`` into a jaxpr trace."""
    i = _internals()
    return i.custom_staging_rules[i.jit_p]


def set_jit_staging_rule(rule: Callable[..., Any]) -> None:
    """Installs ``rule(trace, source_info, *args, **params)`` as the ``jit`` staging rule."""
    i = _internals()
    i.custom_staging_rules[i.jit_p] = rule


def set_current_trace(trace: Any) -> Any:
    """A context in which ``Primitive.bind`` binds into ``trace``."""
    return _internals().set_current_trace(trace)


@contextlib.contextmanager
def replay_context(eqn: Any) -> Iterator[None]:
    """The source location, name stack and context of ``eqn`` while it is bound again into
    another trace, as ``jax.core.eval_jaxpr`` sets them."""
    siu = _internals().source_info_util
    name_stack = siu.current_name_stack() + eqn.source_info.name_stack
    with siu.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        yield


def apply_primitive(p: Any, *args: Any, **params: Any) -> Any:
    """``p`` applied to concrete arrays (compiled once per signature, as JAX's own impls)."""
    try:
        rule = _internals().apply_primitive
    except (ImportError, AttributeError):  # a JAX that moved it: a jit of the bind, uncached
        return jax.jit(lambda *xs: p.bind(*xs, **params))(*args)
    return rule(p, *args, **params)


# ------------------------------------------------------------------------------ lowering


def after_all(tokens: list[Any]) -> Any:
    """One XLA token that follows every token of ``tokens``."""
    return stablehlo.after_all(tokens)


def lowering_into_main() -> bool:
    """Whether ops are being emitted straight into the module's entry function (JAX names
    it ``main``), not into a branch, a loop body or a nested function."""
    ir = mlir.ir
    owner = ir.InsertionPoint.current.block.owner  # pyright: ignore[reportAttributeAccessIssue]
    if owner.operation.name != "func.func":
        return False
    return ir.StringAttr(owner.attributes["sym_name"]).value == "main"


# ------------------------------------------------------------------------------- mpi4jax


@functools.cache
def ordered_effect() -> Any:
    """mpi4jax's ordered effect, imported on first use (importing mpi4jax starts MPI), and
    allowed under ``jax.checkpoint`` (:func:`_allow_under_remat`)."""
    silence_mpi4jax_version_warning()
    from mpi4jax._src.utils import ordered_effect

    _allow_under_remat(type(ordered_effect))
    return ordered_effect


def _allow_under_remat(effect_type: type) -> None:
    """Lets ``jax.checkpoint`` (remat) differentiate a function whose collectives carry
    ``effect_type``: JAX refuses any effect it does not list in ``remat_allowed_effects``
    (``NotImplementedError: Effects not supported in AD of checkpoint/remat``), and a
    collective inside ``jax.checkpoint`` takes the ordered form (the checkpoint is a trace of
    its own, below the jit's level), which carries mpi4jax's ordered effect. Remat may run
    the checkpointed forward pass again in the backward pass, collectives included; every
    rank runs the same program, so every rank runs them again, in the same order, and the
    effect's token orders them as it orders any other. JAX lists its own debug and FFI
    effects there for the same reason (``jax._src.debugging``, ``jax._src.ffi``). The table
    is in jax 0.10 to 0.12; a JAX without it leaves remat refusing the effect, as before."""
    from jax._src import effects

    allowed = getattr(effects, "remat_allowed_effects", None)
    if allowed is not None:
        allowed.add_type(effect_type)


@functools.cache
def mpi4jax_stages_through_host(on: bool) -> None:
    """Tells mpi4jax's CUDA handlers whether to copy GPU buffers to the host for MPI (``on``)
    or hand MPI the GPU buffers themselves (a CUDA-aware MPI). mpi4jax decides it in its own
    lowering rule only (``setup_cuda_mpi``, from ``MPI4JAX_USE_CUDA_MPI``); jaxddp emits
    mpi4jax's targets with its own rules, so without this the handlers keep their compiled
    default, GPU buffers straight to MPI, which a host-only MPI reads as host memory (the
    crash of every multi-rank GPU step before jaxddp did this). A no-op where mpi4jax has no
    CUDA extension (then its CUDA targets are not registered, and compiling says so)."""
    silence_mpi4jax_version_warning()
    from mpi4jax._src import decorators
    from mpi4jax._src.xla_bridge import HAS_CUDA_EXT

    if HAS_CUDA_EXT:  # the extension exists only in builds that found CUDA: no static import
        bridge = importlib.import_module("mpi4jax._src.xla_bridge.mpi_xla_bridge_cuda")
        bridge.set_copy_to_host(on)
        decorators._cuda_mpi_setup_done = True  # mpi4jax's own rule must not undo it


def mpi4jax_has_cuda() -> bool:
    """Whether mpi4jax's CUDA extension imports (its CUDA targets are registered)."""
    silence_mpi4jax_version_warning()
    from mpi4jax._src.xla_bridge import HAS_CUDA_EXT

    return bool(HAS_CUDA_EXT)


def weaken(x: Any) -> Any:
    """``x`` weakly typed, as JAX types a Python number passed to a jitted function."""
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(x, weak_type=True)


def eval_jaxpr(jaxpr: Any, consts: Any, *args: Any) -> list[Any]:
    """``jaxpr`` run on ``args`` in the trace that calls it (its equations bound again)."""
    from jax._src import core

    return core.eval_jaxpr(jaxpr, consts, *args)


def global_array(aval: Any, sharding: Any, block: Any) -> Any:
    """A global array of ``aval`` (with ``sharding`` attached: :func:`sharded_aval`) whose
    one block on this process is ``block``, made without
    ``jax.make_array_from_single_device_arrays``'s checks (a quarter of its time): the
    caller made ``aval``, ``sharding`` and ``block`` agree."""
    from jax._src.array import ArrayImpl

    return ArrayImpl(aval, sharding, [block], committed=True, _skip_checks=True)


def sharded_aval(shape: tuple[int, ...], dtype: Any, weak: bool, sharding: Any) -> Any:
    """The abstract value of a global array of ``shape`` laid out as ``sharding``."""
    from jax._src import core

    aval = core.ShapedArray(shape, dtype, weak_type=weak)
    return core.update_aval_with_sharding(aval, sharding)


def backends_started() -> bool:
    """Whether JAX has made its devices (after that, JAX's distributed runtime cannot start)."""
    from jax._src import xla_bridge

    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(probe()) if probe is not None else bool(getattr(xla_bridge, "_backends", {}))


def silence_mpi4jax_version_warning() -> None:
    """Where jaxddp's suite verified this JAX with this mpi4jax, mpi4jax's import-time warning
    that the JAX is newer than its release knows (mpi4jax 0.9.1 on jax 0.12) says nothing
    more: ``MPI4JAX_NO_WARN_JAX_VERSION=1`` is set, unless the user set it already."""
    if unverified_reason() is None and _minor(_installed("mpi4jax")) in VERIFIED_MPI4JAX:
        os.environ.setdefault("MPI4JAX_NO_WARN_JAX_VERSION", "1")


@functools.cache
def warn_if_unverified() -> None:
    """Warns once when this JAX is outside :data:`VERIFIED`."""
    reason = unverified_reason()
    if reason is None:
        return
    msg = (
        f"{reason}: its collectives inside jax.jit take the ordered path (mpi4jax's ordered "
        "effect) and jaxddp changes nothing of JAX. Results are the same; the cost is JAX's "
        "Python dispatch for every jitted step holding a collective, tens of microseconds per "
        "argument and result leaf (a step with 100 parameter leaves: about 7-15 ms more per "
        "step than on the fast path). `jaxddp doctor` shows the path in use."
    )
    warnings.warn(msg, UnverifiedJaxWarning, stacklevel=2)


# ------------------------------------------------------------------------------- jaxprs


def equation_frames(eqn: Any, limit: int = 3) -> list[str]:
    """``file:line (function)`` of the innermost frames outside JAX that staged ``eqn``
    (where a jaxpr's equation came from), for error messages; empty where unknown."""
    try:
        frames = eqn.source_info.traceback.frames
    except AttributeError:  # a JAX that moved them: the message says less
        return []
    out = []
    for frame in frames:
        if package_of(frame.file_name, ("jax", "jaxlib", "jaxddp")) is not None:
            continue
        short = "/".join(frame.file_name.replace("\\", "/").split("/")[-3:])
        out.append(f"{short}:{frame.line_num} ({frame.function_name})")
        if len(out) == limit:
            break
    return out
