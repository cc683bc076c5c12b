"""The optional integrations: ``jaxddp[grain]``, ``jaxddp[torch]`` and
``jaxddp[checkpoint]`` declare their package, and without it ``import jaxddp.grain`` /
``jaxddp.torch`` and ``jaxddp.CheckpointManager(...)`` name the package to install."""

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
sys.modules["orbax"] = sys.modules["orbax.checkpoint"] = None
import tempfile, jaxddp
try:
    jaxddp.CheckpointManager(tempfile.mkdtemp())
except ImportError as error:
    print(f"checkpoint: {type(error).__name__}: {error}")
"""


@pytest.mark.parametrize(
    ("extra", "package"), [("grain", "grain"), ("torch", "torch"), ("checkpoint", "orbax")]
)
def test_the_extra_installs_its_package(extra, package):
    marker = f'extra == "{extra}"'
    declared = [r for r in requires("jaxddp") or [] if marker in r.replace("'", '"')]
    assert any(r.startswith(package) for r in declared), declared


@pytest.mark.slow
def test_without_its_loader_the_module_names_the_extra_to_install():
    done = fresh_python(["-c", _MISSING], {**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    for name in ("grain", "torch"):
        line = next(x for x in done.stdout.splitlines() if x.startswith(f"{name}: "))
        assert f"jaxddp.{name} needs {name}" in line
        assert f"pip install {name}`" in line  # works without jaxddp on the package index
        assert "jaxddp[" not in line
    # not a ModuleNotFoundError inside the writer's RuntimeError: an ImportError on this
    # rank, before the manager's first collective, saying what to install
    line = next(x for x in done.stdout.splitlines() if x.startswith("checkpoint: "))
    assert line.startswith("checkpoint: ImportError: `jaxddp.CheckpointManager` needs Orbax")
    assert 'pip install "jaxddp[checkpoint]"' in line
