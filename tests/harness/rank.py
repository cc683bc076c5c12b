"""Runs one rank of a launch made by :func:`tests.harness.launch`.

Usage (by the harness, under any launcher): ``python rank.py DIR -- ARGV...`` where ARGV is
what ``python`` would take: ``script.py args``, ``-m module args`` or ``-c code``.

Before running ARGV it sends this rank's stdout and stderr to ``DIR/rank-R.log``, records its
pid in ``DIR/rank-R.pid`` and makes SIGUSR1 dump every thread's Python stack into the log, so
a watchdog can ask a hung rank where it is. Its exit status goes to ``DIR/rank-R.exit``.
With ``JAXDDP_TEST_COMPILE_CACHE`` set (see ``tests/harness``), JAX's persistent compilation
cache is that folder, shared by every rank of every launch of the pytest run, every program
cached however fast it compiled (:class:`ClaimingCache`: the ranks of a launch compile one
program once, not once each). Only the standard library is imported here: nothing may touch
MPI before ARGV does, and jax is not imported for a script that does not import it. The
suite's switches of jaxddp's internals (``switches.py``) are set in every rank, from their
variables.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import importlib.abc
import importlib.util
import os
import pathlib
import runpy
import signal
import sys
import time

# Variables through which launchers tell a process its rank, most specific first.
RANK_VARIABLES = (
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
    "PMI_ID",
    "MV2_COMM_WORLD_RANK",
    "SLURM_PROCID",
)


def launcher_rank() -> str:
    for name in RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return value
    return f"pid{os.getpid()}"


def run(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


COMPILE_CACHE_VARIABLE = "JAXDDP_TEST_COMPILE_CACHE"  # tests.harness's; not imported here
CLAIM_WAIT = 30.0  # seconds a rank waits for a program another process compiles


class ClaimingCache:
    """JAX's persistent compilation cache (the interface of ``jax._src.compilation_cache``:
    ``get(key) -> bytes | None``, ``put(key, bytes)``) in one folder that any number of
    processes share.

    The ranks of a launch run the same programs at about the same time, so with a plain
    shared cache every rank misses and compiles each one. Here the first process that misses
    a key claims it (``KEY-claim``, made with ``O_EXCL``, holding its pid) and compiles; a
    process that misses a claimed key waits for ``KEY-cache`` instead (at most
    :data:`CLAIM_WAIT` s, and only while the claimer lives and holds the claim). Entries are
    written whole (a temporary file, then a rename), so a reader never sees half of one;
    JAX's own file cache writes in place unless ``filelock`` is installed. A claim is
    released when its entry is written, when its process asks for the next program (a
    compile whose entry JAX did not write has ended by then) and when the process exits.
    """

    def __init__(self, path: str) -> None:
        self._path = pathlib.Path(path)  # JAX's caches expose ``_path``
        self._path.mkdir(parents=True, exist_ok=True)
        self._claimed: set[str] = set()
        atexit.register(self._release_all)

    def _file(self, key: str, kind: str):
        return self._path / f"{key}-{kind}"

    def _entry(self, key: str) -> bytes | None:
        try:
            return self._file(key, "cache").read_bytes()
        except FileNotFoundError:
            return None

    def get(self, key: str) -> bytes | None:
        self._release_all()
        if (entry := self._entry(key)) is not None:
            return entry
        try:
            fd = os.open(self._file(key, "claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return self._wait(key)
        with os.fdopen(fd, "w") as claim:
            claim.write(str(os.getpid()))
        self._claimed.add(key)
        return None

    def put(self, key: str, value: bytes) -> None:
        entry = self._file(key, "cache")
        part = entry.with_name(f"{entry.name}.{os.getpid()}.part")
        part.write_bytes(value)
        os.replace(part, entry)
        self._release(key)

    def _wait(self, key: str) -> bytes | None:
        """The entry another process is compiling; None (compile it here) when its claimer
        ends, gives the claim up without an entry, or takes longer than CLAIM_WAIT."""
        claim, deadline = self._file(key, "claim"), time.monotonic() + CLAIM_WAIT
        while True:
            if (entry := self._entry(key)) is not None:
                return entry
            try:
                owner = claim.read_text()
            except FileNotFoundError:  # released: the entry was written just before, or never
                return self._entry(key)
            if owner.isdigit() and not _alive(int(owner)):
                with contextlib.suppress(FileNotFoundError):
                    claim.unlink()
                return None
            if time.monotonic() > deadline:
                sys.stderr.write(f"rank.py: compiling {key} here: its claim ({owner}) is old\n")
                return None
            time.sleep(0.005)

    def _release(self, key: str) -> None:
        if key in self._claimed:
            self._claimed.discard(key)
            with contextlib.suppress(FileNotFoundError):
                self._file(key, "claim").unlink()

    def _release_all(self) -> None:
        for key in list(self._claimed):
            self._release(key)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once the module ``name`` has been executed, if it ever is."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute, then = spec.loader.exec_module, self.then

        def exec_module(module) -> None:
            execute(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


def _share_cache(compilation_cache) -> None:
    """Makes ``jax._src.compilation_cache`` open a :class:`ClaimingCache` (the function it
    opens its file cache with, ``get_file_cache``, is in jax 0.10 to 0.12; elsewhere JAX's
    own cache is used)."""
    if hasattr(compilation_cache, "get_file_cache"):
        compilation_cache.get_file_cache = lambda path: (ClaimingCache(path), path)


def use_compile_cache() -> None:
    """JAX's persistent cache in ``$JAXDDP_TEST_COMPILE_CACHE``, shared through
    :class:`ClaimingCache`; set up before ARGV runs, taking effect if it imports jax."""
    root = os.environ.get(COMPILE_CACHE_VARIABLE)
    if not root or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    os.environ["JAX_COMPILATION_CACHE_DIR"] = root
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    sys.meta_path.insert(0, _AfterImport("jax._src.compilation_cache", _share_cache))


def install_switches() -> None:
    """The suite's switches of jaxddp's internals (``switches.py`` beside this file, loaded by
    its path: the program's ``sys.path`` is left as it is), set from their variables as each
    switched module is imported."""
    path = pathlib.Path(__file__).with_name("switches.py")
    spec = importlib.util.spec_from_file_location("_jaxddp_test_switches", path)
    if spec is None or spec.loader is None:  # pragma: no cover - the file is beside this one
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass or a finder may look its module up
    spec.loader.exec_module(module)
    module.install()


def main() -> None:
    outdir, sep, *argv = sys.argv[1:]
    if sep != "--" or not argv:
        sys.exit("usage: rank.py DIR -- ARGV...")
    rank = launcher_rank()
    argv = [a.replace("{rank}", rank) for a in argv]
    use_compile_cache()
    install_switches()
    # Registered first, so it runs after every other atexit handler (the script's, jaxddp's):
    # the garbage collections of Python's finalization then skip every object made before
    # it. After `import jax` alone they cost 0.3 CPU-s of a 1.5 CPU-s process, and the
    # suite starts a few hundred ranks; what a rank prints and writes is done by then
    # (standard streams are flushed after this, as always).
    atexit.register(gc.freeze)
    stem = os.path.join(outdir, f"rank-{rank}")
    log = open(stem + ".log", "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    with open(stem + ".pid", "w") as f:
        f.write(str(os.getpid()))
    code: int | str | None = 0
    try:
        run(argv)
    except SystemExit as exc:
        code = exc.code
        raise
    except BaseException:
        code = 1
        raise
    finally:
        with open(stem + ".exit", "w") as f:
            f.write(str(code if isinstance(code, int) else (0 if code is None else 1)))


if __name__ == "__main__":
    main()
