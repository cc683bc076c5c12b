"""Runs one rank of a launch made by :func:`tests.harness.launch`.

Usage (by the harness, under any launcher): ``python rank.py DIR -- ARGV...`` where ARGV is
what ``python`` would take: ``script.py args``, ``-m module args`` or ``-c code``.

Before running ARGV it sends this rank's stdout and stderr to ``DIR/rank-R.log``, records its
pid in ``DIR/rank-R.pid`` and makes SIGUSR1 dump every thread's Python stack into the log, so
a watchdog can ask a hung rank where it is. Its exit status goes to ``DIR/rank-R.exit``.
With ``JAXDDP_TEST_COMPILE_CACHE`` set (see ``tests/harness``), JAX's persistent compilation
cache of this rank is that folder's ``rank-R``, every program cached however fast it compiled.
Only the standard library is imported here: nothing may touch MPI before ARGV does.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys

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


def use_compile_cache(rank: str) -> None:
    """JAX's persistent cache in ``$JAXDDP_TEST_COMPILE_CACHE/rank-R``, read at JAX's import."""
    root = os.environ.get(COMPILE_CACHE_VARIABLE)
    if not root or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(root, f"rank-{rank}")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def main() -> None:
    outdir, sep, *argv = sys.argv[1:]
    if sep != "--" or not argv:
        sys.exit("usage: rank.py DIR -- ARGV...")
    rank = launcher_rank()
    argv = [a.replace("{rank}", rank) for a in argv]
    use_compile_cache(rank)
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
