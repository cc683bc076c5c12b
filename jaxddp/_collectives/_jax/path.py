"""Which path jaxddp's collectives take: the fast one (effect-free chained forms, JAX's C++
dispatch) where its ordering was verified, else the ordered one (mpi4jax's effect)."""

from __future__ import annotations

import functools

import jax

from . import compat
from .forms import chained_p

__all__ = ["fast_path", "forced", "path_reason"]

# The test suite's switch between the two paths ("fast" or "ordered"), which it sets from a
# variable of its own (tests/harness/switches.py); None (always, for a user): decided below.
forced: str | None = None


@functools.cache
def path_reason() -> tuple[bool, str]:
    """Whether jaxddp's collectives take the fast path, and why (decided once)."""
    if forced in ("fast", "ordered"):
        fast, why = forced == "fast", f"the test suite's switch: {forced}"
    elif (reason := compat.unverified_reason() or compat.missing_internals()) is not None:
        fast, why = False, reason
    elif jax.default_backend() != "cpu":
        fast, why = False, f"the {jax.default_backend()} backend (the fast path is CPU's)"
    elif jax.local_device_count() != 1:
        fast, why = False, f"{jax.local_device_count()} local devices (the fast path needs one)"
    else:
        jax_version, _ = compat.jax_versions()
        fast, why = True, f"jax {jax_version} on CPU with one local device, verified"
    if fast:
        compat.keep_in_dce(chained_p)  # a chained collective is never dead code
    return fast, why


def fast_path() -> bool:
    """Whether jaxddp's collectives use the effect-free primitives (decided once)."""
    return path_reason()[0]
