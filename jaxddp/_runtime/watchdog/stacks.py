"""Where a rank's main thread is: its stack, the frames of jax, jaxddp, mpi4py and the
standard library folded, so that the user's own innermost frame shows first.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import linecache
import os
import sysconfig
from typing import Any

from ..._base.paths import package_of

# Frames inside these packages (and the standard library) are folded in a stack, so that the
# user's own innermost frame shows first.
_LIBRARIES = frozenset(
    ("jax", "jaxlib", "jaxddp", "mpi4py", "mpi4jax", "numpy", "flax", "optax", "chex", "orbax")
)
# A main thread whose innermost frame is in one of these waits for the other ranks: in a
# collective, or for the result of a compiled step.
_WAITING = frozenset(("jax", "jaxlib", "jaxddp", "mpi4py", "mpi4jax"))
SHOWN_FRAMES = 4  # of the user's, in a report


# -- stacks -------------------------------------------------------------------------------


@functools.cache
def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")})


@functools.cache
def _library(filename: str) -> str | None:
    """The library a source file belongs to (``"jax"``, ``"stdlib"``), or None: user code."""
    if filename.startswith(("<frozen", "<built-in")):
        return "stdlib"
    library = package_of(filename, _LIBRARIES)
    if library is not None:
        return library
    real = os.path.realpath(filename)
    parts = real.split(os.sep)
    installed = "site-packages" in parts or "dist-packages" in parts
    return "stdlib" if not installed and real.startswith(_stdlib_dirs()) else None


def _show_path(filename: str) -> str:
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in filename:
            return filename.split(marker, 1)[1]
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(filename)
        if not relative.startswith(".."):
            return relative
    return filename


def _compiled_call(frame: Any) -> str | None:
    """The name of a compiled function (``jax.jit``, ``nnx.jit``) that ``frame``'s current
    line calls, if any: a thread blocked there waits for a compiled step, which has no
    Python frame of its own. Read from the line's source, at report time only."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    scopes = (frame.f_locals, frame.f_globals, vars(builtins))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        names: list[str] = []
        func = node.func
        while isinstance(func, ast.Attribute):
            names.insert(0, func.attr)
            func = func.value
        if not isinstance(func, ast.Name):
            continue
        scope = next((s for s in scopes if func.id in s), None)
        if scope is None:
            continue
        obj = scope[func.id]
        with contextlib.suppress(Exception):
            for name in names:
                obj = getattr(obj, name)
            if callable(obj) and hasattr(obj, "lower"):
                return ".".join([func.id, *names])
    return None


def folded_stack(frame: Any) -> tuple[list[str], str | None, str | None]:
    """A stack as a stall report shows it, from its innermost frame ``frame``.

    Returns ``(user, inner, waiting)``: the user's own frames, innermost first, as
    ``file:line in function``; the innermost folded library frame above them (None when
    the innermost frame is the user's); and what the thread waits in when that is for the
    other ranks (a frame of jaxddp, jax or mpi4py, or a line calling a compiled function),
    else None.
    """
    frames: list[Any] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    shown = [
        f"{_show_path(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}" for f in frames
    ]
    libs = [_library(f.f_code.co_filename) for f in frames]
    user = [s for s, lib in zip(shown, libs, strict=True) if lib is None]
    inner = shown[0] if frames and libs[0] is not None else None
    waiting = None
    if frames and libs[0] in _WAITING:
        waiting = f"{libs[0]} (a collective, or a compiled step's result)"
    elif frames and libs[0] is None:
        name = _compiled_call(frames[0])
        waiting = None if name is None else f"the compiled function `{name}`"
    return user, inner, waiting
