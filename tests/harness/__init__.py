"""Launches real MPI jobs for the tests, with a watchdog that turns a hang into a failure.

Every rank runs under ``rank.py`` (see there), which keeps a log per rank and lets the
watchdog ask each rank for its Python stacks before the job is killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RANK_WRAPPER = Path(__file__).with_name("rank.py")
DEFAULT_TIMEOUT = 120.0
TIMEOUT_VARIABLE = "JAXDDP_TEST_TIMEOUT"
# Set in every rank of a launch, so the test plugin knows it is inside one.
RANK_RUN_VARIABLE = "JAXDDP_TEST_RANK_RUN"
# A folder (tests/conftest.py makes one per pytest run, its xdist workers inherit it) that
# every rank of every launch uses as JAX's persistent compilation cache (``rank.py``:
# ``ClaimingCache``): the ranks of a launch compile the same programs at the same time, and
# the suite's launches run the same few scripts again and again. The first process to miss
# a program compiles it; the others wait for its entry.
COMPILE_CACHE_VARIABLE = "JAXDDP_TEST_COMPILE_CACHE"
# What ``launch(..., quick=True)`` adds to a launch's environment: settings that make a test
# job cheaper on a shared machine without changing what it tests (docs/testing.md, "Quick
# launches"). MPICH's waits sleep instead of spinning (a rank waiting in a collective gives
# its core to the ranks and processes that work; the stall inspector's progress signal needs
# the spin, so test_stall.py and the examples run without it), and XLA's compiler skips
# LLVM's optimizations (the programs are the same HLO; tests/mpi's jobs compile far more
# than they run).
QUICK_ENV = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0"


# The stand-in for the CUDA driver (tests/native/driver.c) and the value of a launch
# variable that stands for its compiled library (tests/mpi modules' MPI_VARIANTS name it so:
# their plan is read without running anything).
STAND_IN_SOURCE = Path(__file__).parents[1] / "native" / "driver.c"
STAND_IN_DRIVER = "<stand-in CUDA driver>"


def stand_in_driver() -> Path:
    """tests/native/driver.c compiled (once per source, by the first process to need it) into
    the system's temporary folder: what ``JAXDDP_TEST_CUDA_DRIVER`` names in place of
    libcuda.so.1 (jaxddp/_base/cuda.py)."""
    import fcntl
    import hashlib

    source = STAND_IN_SOURCE.read_bytes()
    key = hashlib.sha256(source).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / "jaxddp-test-stand-in"
    folder.mkdir(exist_ok=True)
    library = folder / f"libcuda-{key}.so"
    with open(folder / f"libcuda-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            scratch = folder / f"libcuda-{key}.{os.getpid()}.so"
            command = ["cc", "-O2", "-shared", "-fPIC", str(STAND_IN_SOURCE), "-o", str(scratch)]
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            scratch.replace(library)
    return library


def with_stand_in(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`STAND_IN_DRIVER` values replaced by the compiled stand-in's path."""
    if STAND_IN_DRIVER not in env.values():
        return env
    path = str(stand_in_driver())
    return {k: path if v == STAND_IN_DRIVER else v for k, v in env.items()}


def fresh_python(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """A fresh Python of this venv (one process, no launcher), its output captured."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def quick_env(env: dict[str, str], *, optimized: bool = False) -> dict[str, str]:
    """``env`` with :data:`QUICK_ENV` and (unless ``optimized``) :data:`QUICK_XLA_FLAGS`
    added (``XLA_FLAGS`` that ``env`` already has are kept, after ours, so a test's own flags
    win)."""
    env = {**env, **QUICK_ENV}
    if not optimized:
        env["XLA_FLAGS"] = " ".join(f for f in (QUICK_XLA_FLAGS, env.get("XLA_FLAGS", "")) if f)
    return env


def default_timeout() -> float:
    return float(os.environ.get(TIMEOUT_VARIABLE, DEFAULT_TIMEOUT))


def default_mpiexec() -> str:
    """The mpiexec beside the Python in use (the mpich wheel's in a nox venv)."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


@dataclass
class LaunchResult:
    """What a launch left behind: exit status, the launcher's output and every rank's log."""

    command: list[str]
    np: int
    returncode: int | None
    timed_out: bool
    elapsed: float
    output: str
    first_text: float | None = None
    rank_logs: dict[str, str] = field(default_factory=dict)
    rank_exits: dict[str, int] = field(default_factory=dict)
    directory: Path | None = None

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.returncode == 0

    @property
    def after_first_text(self) -> float:
        """Seconds from the ranks' first text to the job's end: a bound on how fast a job
        ends that its ranks' start (seconds, several times more on a loaded machine) does not
        count in. The whole ``elapsed`` when no rank wrote anything."""
        return self.elapsed - (self.first_text or 0.0)

    def failed_ranks(self) -> list[str]:
        return sorted(r for r, code in self.rank_exits.items() if code != 0)

    def report(self) -> str:
        if self.timed_out:
            head = (
                f"deadlock suspected: {self.np} ranks still running after {self.elapsed:.1f} s; "
                "each rank's Python stack was dumped before the job was killed"
            )
        elif self.returncode == 0:
            head = f"{self.np} ranks exited 0 in {self.elapsed:.1f} s"
        else:
            exits = ", ".join(f"rank {r}: {c}" for r, c in sorted(self.rank_exits.items()))
            head = (
                f"the launch exited {self.returncode} after {self.elapsed:.1f} s"
                f" ({exits or 'no rank recorded an exit status'})"
            )
        parts = [head, "command: " + " ".join(self.command)]
        for r, text in sorted(self.rank_logs.items()):
            parts.append(f"----- rank {r} -----\n{text.rstrip()}")
        if self.output.strip():
            parts.append(f"----- launcher -----\n{self.output.rstrip()}")
        return "\n".join(parts)


def _read_rank_files(directory: Path, suffix: str) -> dict[str, str]:
    return {
        p.name[len("rank-") : -len(suffix)]: p.read_text(errors="replace")
        for p in sorted(directory.glob(f"rank-*{suffix}"))
    }


def _ask_for_stacks_and_kill(proc: subprocess.Popen[str], directory: Path) -> None:
    pids = [int(p) for p in _read_rank_files(directory, ".pid").values() if p.strip()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    # Give faulthandler a moment; it writes from the signal handler itself.
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        logs = _read_rank_files(directory, ".log").values()
        if len(logs) >= len(pids) and all("most recent call first" in t for t in logs):
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _log_sizes(directory: Path) -> tuple[int, ...]:
    return tuple(p.stat().st_size for p in sorted(directory.glob("rank-*.log")))


def _wait(
    proc: subprocess.Popen[str],
    directory: Path,
    deadline: float,
    quiet: float | None,
    started: float | None = None,
) -> tuple[str | None, float | None]:
    """Waits for the job and returns the launcher's output (None when the job ran past
    ``deadline``, or, with ``quiet``, when no rank's log grew for ``quiet`` seconds, counted
    from the launch; with ``started``, from the logs' first text, and ``started`` is the
    latest moment for it) and the moment a rank's log first held text (None: never)."""
    sizes = _log_sizes(directory)
    grew = time.monotonic()
    if started is not None and quiet is not None:
        grew = started - quiet  # no text by ``started``: hung
    first = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, first
        try:
            output, _ = proc.communicate(timeout=min(left, 0.5))
        except subprocess.TimeoutExpired:  # communicate() may be called again
            pass
        else:
            if first is None and any(_log_sizes(directory)):
                first = time.monotonic()  # all of it written within the last look
            return output, first
        now = _log_sizes(directory)
        if now != sizes:
            sizes = now
            if any(now):  # their text, not their creation
                grew = time.monotonic()
                first = grew if first is None else first
        elif quiet is not None and time.monotonic() - grew >= quiet:
            return None, first


def launch(
    argv: list[str],
    np: int,
    *,
    timeout: float | None = None,
    mpiexec: str | None = None,
    launcher_args: tuple[str, ...] = (),
    python: str | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    directory: str | Path | None = None,
    quiet: float | None = None,
    start: float | None = None,
    compile_cache: bool = True,
    quick: bool = False,
    optimized: bool = False,
) -> LaunchResult:
    """Runs ``python ARGV`` on ``np`` ranks and waits at most ``timeout`` seconds.

    ``{rank}`` in ARGV becomes the rank's number. ``directory`` keeps the rank files (a
    temporary folder by default). ``quiet``, when given, also ends the job as hung once no
    rank's log has grown for that many seconds (a long job of many short steps, each of
    which writes a line, gets a generous ``timeout`` and a short ``quiet``).
    With ``start`` too, that count begins when a rank's log first grows, and a job whose
    ranks wrote nothing in ``start`` seconds is hung: their start (imports, ``MPI_Init``:
    seconds, several times more on a loaded machine) gets ``start`` seconds, and a job that
    prints, then hangs, ends ``quiet`` seconds after its last line.
    ``compile_cache=False`` keeps the ranks off the suite's compilation cache
    (``COMPILE_CACHE_VARIABLE``): a test that reads XLA's compile log. ``quick=True`` runs
    the ranks with :func:`quick_env`: for jobs that do not test the stall inspector and are
    not an example run as a user runs it; ``optimized=True`` keeps LLVM's optimizations in
    such a job (its programs run long). Never raises
    on a failed or hung job: the result says what happened, and ``report()`` shows it with
    every rank's output.
    """
    timeout = default_timeout() if timeout is None else timeout
    mpiexec = mpiexec or default_mpiexec()
    python = python or sys.executable
    owned = directory is None
    outdir = Path(tempfile.mkdtemp(prefix="jaxddp-launch-") if owned else str(directory))
    outdir.mkdir(parents=True, exist_ok=True)
    command = [
        mpiexec,
        *launcher_args,
        "-n",
        str(np),
        python,
        str(RANK_WRAPPER),
        str(outdir),
        "--",
        *argv,
    ]
    full_env = dict(os.environ if env is None else env)
    full_env[RANK_RUN_VARIABLE] = "1"
    if not compile_cache:
        full_env.pop(COMPILE_CACHE_VARIABLE, None)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if quick:
        full_env = quick_env(full_env, optimized=optimized)
    begun = time.monotonic()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    output, first = _wait(
        proc, outdir, begun + timeout, quiet, None if start is None else begun + start
    )
    timed_out = output is None
    if timed_out:
        _ask_for_stacks_and_kill(proc, outdir)
        output, _ = proc.communicate()
    elapsed = time.monotonic() - begun
    exits = {r: int(code) for r, code in _read_rank_files(outdir, ".exit").items() if code.strip()}
    logs = _read_rank_files(outdir, ".log")
    if owned:
        shutil.rmtree(outdir, ignore_errors=True)
    return LaunchResult(
        command=command,
        np=np,
        returncode=None if timed_out else proc.returncode,
        timed_out=timed_out,
        elapsed=elapsed,
        output=output or "",
        first_text=None if first is None else first - begun,
        rank_logs=logs,
        rank_exits=exits,
        directory=None if owned else outdir,
    )
