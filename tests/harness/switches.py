"""The test suite's three switches of jaxddp's internals, set from environment variables.

jaxddp reads no test variable itself: each switch is a module attribute of the package, None
or False for a user. :func:`install` sets them, in every process the suite starts, from:

* ``JAXDDP_TEST_CUDA_DRIVER``: the path of a stand-in for ``libcuda.so.1``
  (``tests/native/driver.c``), ``jaxddp._base.cuda.stand_in``;
* ``JAXDDP_TEST_STAGED``: any value but empty or ``0``: programs compiled for the CPU use the
  staged (GPU) handlers too, ``jaxddp._native.staged.on_cpu``;
* ``JAXDDP_TEST_COLLECTIVE_PATH``: ``fast`` or ``ordered``, the path of jaxddp's collectives,
  ``jaxddp._collectives._jax.path.forced``.

Some are read while ``import jaxddp`` runs (the CUDA driver, to assign GPUs), so a switch is
set the moment its module is imported, by a finder at the head of ``sys.meta_path``, before
anything else of the package uses it. It is installed by ``tests/conftest.py`` (pytest, and the
ranks' pytest), ``rank.py`` (every rank of a launch, whatever it runs) and the benchmarks;
a subprocess of a test that runs ``python -c`` puts :data:`PRELUDE` first. Only the standard
library is imported here: nothing of jaxddp, nothing that touches MPI.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

DRIVER_VARIABLE = "JAXDDP_TEST_CUDA_DRIVER"
STAGED_VARIABLE = "JAXDDP_TEST_STAGED"
PATH_VARIABLE = "JAXDDP_TEST_COLLECTIVE_PATH"


def _path(value: str) -> str | None:
    forced = value.strip().lower()
    return forced if forced in ("fast", "ordered") else None


# module: (its attribute, the variable, the attribute's value from the variable's)
SWITCHES: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "jaxddp._base.cuda": ("stand_in", DRIVER_VARIABLE, lambda v: v or None),
    "jaxddp._native.staged": ("on_cpu", STAGED_VARIABLE, lambda v: v not in ("", "0")),
    "jaxddp._collectives._jax.path": ("forced", PATH_VARIABLE, _path),
}
# Put first in a `python -c` program of a subprocess that should see the switches.
PRELUDE = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r}); "
    "from tests.harness.switches import install; install()\n"
)


def _set(module: ModuleType) -> None:
    attribute, variable, value = SWITCHES[module.__name__]
    if variable in os.environ:
        setattr(module, attribute, value(os.environ[variable]))


class _Loader(importlib.abc.Loader):
    """The module's own loader, then its switch."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _set(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a switched module with the other finders and wraps its loader."""

    jaxddp_switches = True  # one finder, however many copies of this module were loaded

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in SWITCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Sets the switches of the modules imported already, and of each one when it is."""
    for name in SWITCHES:
        if (module := sys.modules.get(name)) is not None:
            _set(module)
    if not any(getattr(f, "jaxddp_switches", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
