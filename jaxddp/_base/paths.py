"""Which installed package a source file belongs to, by where the package is: a leaf module.

By location, not by a folder's name: a program (or a clone of this repository) whose own path
holds a folder called ``jax`` or ``jaxddp`` is still the user's code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

__all__ = ["package_of"]


def _roots(name: str) -> list[str]:
    """The folders of the imported package ``name`` (real paths, with a trailing separator);
    empty while it is not imported (then no frame runs its code)."""
    module = sys.modules.get(name)
    paths = list(getattr(module, "__path__", None) or [])
    return [os.path.join(os.path.realpath(p), "") for p in paths]


def package_of(filename: str, names: Iterable[str]) -> str | None:
    """The first of the packages ``names`` whose folder holds ``filename``, else None."""
    real = os.path.realpath(filename)
    for name in names:
        if any(real.startswith(root) for root in _roots(name)):
            return name
    return None
