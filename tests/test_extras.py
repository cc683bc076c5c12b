"""The optional integrations: ``jaxddp[grain]`` and ``jaxddp[torch]`` declare their loader,
and without it ``import jaxddp.grain`` / ``jaxddp.torch`` names the extra to install."""

import os
from importlib.metadata import requires

import pytest

from tests.harness import fresh_python

_MISSING = """
import sys
for name in ("grain", "torch"):
    sys.modules[name] = None  # as if it were not installed
    try:
        __import__(f"jaxddp.{name}")
    except ImportError as error:
        print(f"{name}: {error}")
"""


@pytest.mark.parametrize("extra", ["grain", "torch"])
def test_the_extra_installs_its_loader(extra):
    marker = f'extra == "{extra}"'
    declared = [r for r in requires("jaxddp") or [] if marker in r.replace("'", '"')]
    assert any(r.startswith(extra) for r in declared), declared


@pytest.mark.slow
def test_without_its_loader_the_module_names_the_extra_to_install():
    done = fresh_python(["-c", _MISSING], {**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    for name in ("grain", "torch"):
        line = next(x for x in done.stdout.splitlines() if x.startswith(f"{name}: "))
        assert f"jaxddp.{name} needs {name}" in line
        assert f"pip install 'jaxddp[{name}]'" in line
