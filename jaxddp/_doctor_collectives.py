"""``jaxddp doctor``'s lines on how collectives run.

Under ``JAXDDP_COLLECTIVES=mpi`` (the default): the MPI path's form inside ``jax.jit`` (fast
or ordered, and why) and the handler of jitted allreduces. Under ``xla``: first what a step in
``jaxddp.spmd`` takes (JAX's own collectives, ``psum`` and the rest, over gloo on CPUs or NCCL
on GPUs), then the MPI path, which serves the collectives outside such a step.
"""

from __future__ import annotations

from ._base import settings as _settings
from ._collectives._jax import xla as _xla
from ._runtime import launcher as _launcher

__all__ = ["backend", "lines", "setting"]

PATH_TEXT = {
    "fast": "no JAX effect inside jax.jit, so jitted steps keep JAX's C++ dispatch.",
    "ordered": (
        "mpi4jax's ordered effect inside jax.jit, so every jitted step holding a collective "
        "takes JAX's Python dispatch (tens of microseconds per argument and result leaf)."
    ),
}
_INDENT = " " * 16


def backend() -> str:
    """The JAX backend a ``jaxddp.spmd`` step runs on here."""
    import jax

    return jax.default_backend()


def setting(step_backend: str | None) -> str:
    """``JAXDDP_COLLECTIVES``'s value and what it means for steps in ``jaxddp.spmd``
    (``step_backend``: their backend under ``xla``, None under ``mpi``)."""
    if step_backend is None:
        return f"{_settings.collectives()} (steps in jaxddp.spmd)"
    return f"xla (steps in jaxddp.spmd: psum over {_xla.transport(step_backend)})"


def lines(path: str, reason: str, handler: str, step_backend: str | None) -> list[str]:
    """The doctor's lines on the collectives: the MPI path's ``path`` ("fast" or
    "ordered") and why, its allreduce ``handler``; before them, under ``xla``
    (``step_backend`` set), the path steps in ``jaxddp.spmd`` take."""
    wrap = _launcher.wrap
    mpi = f"{path} path, {reason}: {PATH_TEXT[path]}"
    if step_backend is None:
        return [
            *wrap(f"collectives:  {mpi}", "  ", _INDENT),
            *wrap(f"allreduce:    {handler}", "  ", _INDENT),
        ]
    name = _settings.COLLECTIVES.name
    return [
        *wrap(
            f"collectives:  xla path ({name}=xla): {_xla.describe(step_backend)}.", "  ", _INDENT
        ),
        *wrap(
            f"outside:      a collective outside a jaxddp.spmd step takes the {mpi}", "  ", _INDENT
        ),
        *wrap(f"allreduce:    outside a jaxddp.spmd step, {handler}", "  ", _INDENT),
    ]
