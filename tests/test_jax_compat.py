"""The JAX versions jaxddp was verified on, and what it does on any other.

Every JAX and mpi4jax internal jaxddp uses is in one module,
``jaxddp._collectives._jax.compat``. On a JAX outside its verified range jaxddp warns once,
takes the ordered path (mpi4jax's ordered effect) and changes none of JAX's rules;
``tests/scripts/unverified_jax.py`` fakes such a JAX on real ranks and checks values, the
path and JAX's staging rule.
"""

import json
import os
import re
from pathlib import Path

import jax

from jaxddp._collectives._jax import compat as _jax_compat
from jaxddp._collectives._jax import path as _path
from tests.harness import fresh_python, launch
from tests.harness.switches import PATH_VARIABLE, PRELUDE

ROOT = Path(__file__).parent.parent
SCRIPTS = Path(__file__).with_name("scripts")


def test_only_the_compat_module_imports_jax_or_mpi4jax_internals():
    internal = re.compile(r"\b(jax|mpi4jax)\._src\b")
    users = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "jaxddp").rglob("*.py")
        if internal.search(path.read_text())
    )
    assert users == ["jaxddp/_collectives/_jax/compat.py"]


def test_this_jax_is_verified():
    assert _jax_compat.unverified_reason() is None, (
        f"{_jax_compat.unverified_reason()}: check the ordering tests (tests/test_ordering.py, "
        "tests/mpi/test_ordering.py) on it, then add it to "
        "jaxddp._collectives._jax.compat.VERIFIED."
    )
    assert _jax_compat.missing_internals() is None


def test_an_unverified_jax_warns_takes_the_ordered_path_and_leaves_jax_alone():
    env = {k: v for k, v in os.environ.items() if k != PATH_VARIABLE}
    result = launch([str(SCRIPTS / "unverified_jax.py")], 2, timeout=180, env=env)
    assert result.ok, result.report()
    assert all("unverified ok" in log for log in result.rank_logs.values()), result.report()


def test_mpi4jax_imports_after_jaxddp_without_a_warning_on_a_verified_jax():
    # mpi4jax 0.9.1 warns on jax 0.12 that it knows 0.11.2 at most; jaxddp verified the pair
    env = {k: v for k, v in os.environ.items() if k != "MPI4JAX_NO_WARN_JAX_VERSION"}
    result = fresh_python(["-W", "error", "-c", "import jaxddp, mpi4jax"], env)
    assert result.returncode == 0, result.stderr


def test_doctor_says_which_collective_path_is_active_and_why():
    code = PRELUDE + "from jaxddp._cli import main; raise SystemExit(main(['doctor', '--json']))"
    for forced in ("", "ordered"):
        env = dict(os.environ, **{PATH_VARIABLE: forced})
        result = fresh_python(["-c", code], env)
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        if forced:
            assert doc["collective_path"] == "ordered"
            assert doc["collective_path_reason"] == "the test suite's switch: ordered"
        else:
            assert doc["collective_path"] == ("fast" if _path.fast_path() else "ordered")
            assert jax.__version__ in doc["collective_path_reason"]
