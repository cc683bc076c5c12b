"""The stall inspector: a thread on every rank that names the ranks behind when a job hangs.

Started with MPI (:func:`start`, at ``import jaxddp``), on a communicator of its own (a
duplicate of ``COMM_WORLD``), it talks point to point with rank 0 once a second, without
ever blocking: every rank sends rank 0 its progress count (:mod:`jaxddp._progress`), and
rank 0 decides. After ``JAXDDP_STALL_WARN`` seconds with no progress on any rank, rank 0 asks
every rank for a snapshot (progress, label, seconds since its last progress, its main
thread's stack) and prints one report, the ranks behind first; a rank that does not answer
within a few seconds is named as such. After ``JAXDDP_STALL_ABORT`` seconds it prints the
report and calls ``MPI_Abort``.

At exit every rank keeps its watchdog running until all ranks have reached their exit (a
nonblocking barrier on the watchdog's communicator): a rank that left the loop early is then
shown as exited, with the line of its ``sys.exit``, while the others hang in a collective.

Before ``MPI_Init`` (:func:`startup_guard`): a rank that dies before starting MPI leaves the
others in ``MPI_Init`` forever, holding the GIL, where no Python thread can run. A small
watcher process is started beside each rank that expects a world of more than one; if
``MPI_Init`` has not returned after ``JAXDDP_STALL_ABORT`` (or ``JAXDDP_STARTUP_TIMEOUT``)
seconds, it prints why and kills the rank.
"""

from __future__ import annotations

import ast
import atexit
import builtins
import contextlib
import functools
import linecache
import math
import os
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from . import _exit, _progress, _settings

__all__ = ["folded_stack", "render", "start", "startup_guard"]

_TAG_STATUS, _TAG_REQUEST, _TAG_REPORT = 7301, 7302, 7303
# Frames inside these packages (and the standard library) are folded in a stack, so that the
# user's own innermost frame shows first.
_LIBRARIES = frozenset(
    ("jax", "jaxlib", "jaxddp", "mpi4py", "mpi4jax", "numpy", "flax", "optax", "chex", "orbax")
)
# A main thread whose innermost frame is in one of these waits for the other ranks: in a
# collective, or for the result of a compiled step.
_WAITING = frozenset(("jax", "jaxlib", "jaxddp", "mpi4py", "mpi4jax"))
_SHOWN_FRAMES = 4

_watchdog: _Watchdog | _Off | None = None


# -- stacks -------------------------------------------------------------------------------


@functools.cache
def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")})


@functools.cache
def _library(filename: str) -> str | None:
    """The library a source file belongs to (``"jax"``, ``"stdlib"``), or None: user code."""
    if filename.startswith(("<frozen", "<built-in")):
        return "stdlib"
    real = os.path.realpath(filename)
    parts = real.split(os.sep)
    for part in parts[:-1]:
        if part in _LIBRARIES:
            return part
    installed = "site-packages" in parts or "dist-packages" in parts
    return "stdlib" if not installed and real.startswith(_stdlib_dirs()) else None


def _show_path(filename: str) -> str:
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in filename:
            return filename.split(marker, 1)[1]
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(filename)
        if not relative.startswith(".."):
            return relative
    return filename


def _compiled_call(frame: Any) -> str | None:
    """The name of a compiled function (``jax.jit``, ``nnx.jit``) that ``frame``'s current
    line calls, if any: a thread blocked there waits for a compiled step, which has no
    Python frame of its own. Read from the line's source, at report time only."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    scopes = (frame.f_locals, frame.f_globals, vars(builtins))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        names: list[str] = []
        func = node.func
        while isinstance(func, ast.Attribute):
            names.insert(0, func.attr)
            func = func.value
        if not isinstance(func, ast.Name):
            continue
        scope = next((s for s in scopes if func.id in s), None)
        if scope is None:
            continue
        obj = scope[func.id]
        with contextlib.suppress(Exception):
            for name in names:
                obj = getattr(obj, name)
            if callable(obj) and hasattr(obj, "lower"):
                return ".".join([func.id, *names])
    return None


def folded_stack(frame: Any) -> tuple[list[str], str | None, str | None]:
    """A stack as a stall report shows it, from its innermost frame ``frame``.

    Returns ``(user, inner, waiting)``: the user's own frames, innermost first, as
    ``file:line in function``; the innermost folded library frame above them (None when
    the innermost frame is the user's); and what the thread waits in when that is for the
    other ranks (a frame of jaxddp, jax or mpi4py, or a line calling a compiled function),
    else None.
    """
    frames: list[Any] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    shown = [
        f"{_show_path(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}" for f in frames
    ]
    libs = [_library(f.f_code.co_filename) for f in frames]
    user = [s for s, lib in zip(shown, libs, strict=True) if lib is None]
    inner = shown[0] if frames and libs[0] is not None else None
    waiting = None
    if frames and libs[0] in _WAITING:
        waiting = f"{libs[0]} (a collective, or a compiled step's result)"
    elif frames and libs[0] is None:
        name = _compiled_call(frames[0])
        waiting = None if name is None else f"the compiled function `{name}`"
    return user, inner, waiting


# -- start-up -----------------------------------------------------------------------------

_STARTUP_WATCHER = r"""
import os, select, sys
fd, seconds, pid, rank = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ready, _, _ = select.select([fd], [], [], None if seconds == float("inf") else seconds)
if not ready:
    os.write(2, (
        f"jaxddp: rank {rank} waited {seconds:g} s in MPI_Init for the other ranks, and some "
        "never arrived: a rank probably died before initializing MPI (an error before or "
        "while importing jaxddp, such as a missing data file). Look for its traceback in the "
        "job's output. Killing this rank so that the job ends instead of hanging "
        "(JAXDDP_STALL_ABORT, or JAXDDP_STARTUP_TIMEOUT when that is unset, sets this "
        "limit).\n"
    ).encode())
    os.kill(pid, 9)
"""


def _expected_world() -> tuple[int | None, int | None]:
    """(world size, rank) as the launcher's environment says, before ``MPI_Init``."""
    from ._launcher.kinds import detect

    launch = detect(os.environ)
    if launch.name.startswith("none"):
        return 1, 0
    return launch.world_size, launch.rank


@contextlib.contextmanager
def startup_guard() -> Iterator[None]:
    """Around ``MPI_Init``: a watcher process kills this rank if it waits there too long.

    ``MPI_Init`` holds the GIL while it waits, so no Python thread could act; the watcher is
    a separate process that exits as soon as the pipe to this one closes (``MPI_Init``
    returned, or this process ended).
    """
    size, rank = _expected_world()
    seconds = _settings.startup_timeout()
    if size == 1 or math.isinf(seconds):
        yield
        return
    read, write = os.pipe()
    try:
        watcher = subprocess.Popen(
            [
                *(sys.executable, "-I", "-S", "-c", _STARTUP_WATCHER, str(read), repr(seconds)),
                *(str(os.getpid()), "?" if rank is None else str(rank)),
            ],
            pass_fds=(read,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
    except OSError:  # no process to spare: start MPI unguarded
        os.close(read)
        os.close(write)
        yield
        return
    os.close(read)
    try:
        yield
    finally:
        os.close(write)
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(timeout=5)


# -- the watchdog thread ------------------------------------------------------------------


def start(MPI: ModuleType) -> None:
    """Starts the stall inspector on every rank, once; call it on the main thread of every
    rank (it duplicates ``COMM_WORLD``, a collective), after ``MPI_Init``."""
    global _watchdog
    if _watchdog is not None:
        return
    warn, abort = _settings.stall_warn(), _settings.stall_abort()
    world = MPI.COMM_WORLD
    if warn == 0 or world.Get_size() == 1 or MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        _watchdog = _Off()
        return
    _exit.install()
    _watchdog = _Watchdog(MPI, world.Dup(), warn, abort)
    _watchdog.thread.start()
    atexit.register(_watchdog.at_exit)


class _Off:
    """The watchdog when it is off (``JAXDDP_STALL_WARN=0``, a world of one)."""


class _Watchdog:
    def __init__(self, MPI: ModuleType, comm: Any, warn: float, abort: float | None) -> None:
        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.warn, self.abort = warn, abort
        self.tick = min(1.0, warn / 5)
        self.answer_within = max(2.0, min(5.0, warn / 2))
        self.main = threading.main_thread().ident
        self.exiting = threading.Event()
        self.done = threading.Event()
        self.exited_at: float | None = None
        self.seen, self.changed = -1, time.monotonic()
        self.sends: list[Any] = []
        self.thread = threading.Thread(target=self._run, name="jaxddp-watchdog", daemon=True)
        # rank 0's view of every rank
        self.counts = np.zeros(self.size, np.int64)
        self.exited = np.zeros(self.size, bool)
        self.heard = np.full(self.size, time.monotonic())
        self.status_in: list[tuple[Any, Any]] = []
        self.last_total: tuple[int, int] = (-1, -1)
        self.progress_at = time.monotonic()
        self.reported_at: float | None = None
        self.seq = 0

    # the main thread, at exit
    def at_exit(self) -> None:
        """Keeps answering until every rank has reached its exit; then lets MPI finalize."""
        self.exited_at = time.monotonic()
        self.exiting.set()
        while self.thread.is_alive() and not self.done.wait(0.1):
            pass

    # the thread
    def _run(self) -> None:
        barrier = None
        if self.rank == 0:
            self._post_status_receives()
        broken = False
        while True:
            if self.exiting.is_set() and barrier is None:
                barrier = self.comm.Ibarrier()
            if barrier is not None and barrier.Test():
                break
            if not broken:
                try:
                    self._step()
                except Exception as exc:  # noqa: BLE001 - the inspector must never end the job
                    broken = True
                    sys.stderr.write(f"jaxddp: the stall inspector stopped: {exc!r}\n")
            time.sleep(self.tick)
        for request, _ in self.status_in:
            with contextlib.suppress(Exception):
                request.Cancel()
                request.Wait()
        self.done.set()

    def _step(self) -> None:
        now = time.monotonic()
        count = _progress.count
        if count != self.seen:
            self.seen, self.changed = count, now
        self.sends = [r for r in self.sends if not r.Test()]
        if self.rank == 0:
            self._lead(now)
            return
        if not self.sends:
            status = np.array([count, self.exiting.is_set()], np.int64)
            self.sends.append(self.comm.Isend(status, dest=0, tag=_TAG_STATUS))
            self._keep = status
        while self.comm.Iprobe(source=0, tag=_TAG_REQUEST):
            seq = self.comm.recv(source=0, tag=_TAG_REQUEST)
            self.sends.append(self.comm.isend(self.snapshot(seq), dest=0, tag=_TAG_REPORT))

    def _post_status_receives(self) -> None:
        for r in range(1, self.size):
            buffer = np.zeros(2, np.int64)
            self.status_in.append((self.comm.Irecv(buffer, source=r, tag=_TAG_STATUS), buffer))

    def _lead(self, now: float) -> None:
        for r in range(1, self.size):
            request, buffer = self.status_in[r - 1]
            while request.Test():
                self.counts[r], self.exited[r], self.heard[r] = buffer[0], bool(buffer[1]), now
                request = self.comm.Irecv(buffer, source=r, tag=_TAG_STATUS)
                self.status_in[r - 1] = (request, buffer)
        self.counts[0], self.exited[0], self.heard[0] = self.seen, self.exiting.is_set(), now
        total = (int(self.counts.sum()), int(self.exited.sum()))
        if total != self.last_total:
            if self.reported_at is not None:
                sys.stderr.write(
                    f"jaxddp: progress resumed after {now - self.progress_at:.0f} s without.\n"
                )
                self.reported_at = None
            self.last_total, self.progress_at = total, now
            return
        stalled = now - self.progress_at
        if self.abort is not None and stalled >= self.abort:
            self._print(render(self.gather(), stalled, self.warn, self.abort, aborting=True))
            self.MPI.COMM_WORLD.Abort(1)
        elif stalled >= self.warn and (
            self.reported_at is None or now - self.reported_at >= self.warn
        ):
            self._print(render(self.gather(), stalled, self.warn, self.abort, aborting=False))
            self.reported_at = time.monotonic()

    @staticmethod
    def _print(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    def snapshot(self, seq: int) -> dict[str, Any]:
        """What this rank tells rank 0 for a report."""
        now = time.monotonic()
        frame = None if self.main is None else sys._current_frames().get(self.main)
        user, inner, waiting = folded_stack(frame)
        exited = None
        if self.exited_at is not None:
            code = _exit.status
            how = (
                "reached the end of the program"
                if _exit.where is None
                else (f"called sys.exit({code!r}) at {_exit.where}")
            )
            exited = (now - self.exited_at, how)
        return {
            "seq": seq,
            "rank": self.rank,
            "count": self.seen,
            "label": _progress.label,
            "since": now - self.changed,
            "user": user[:_SHOWN_FRAMES],
            "inner": inner,
            "waiting": waiting,
            "exited": exited,
        }

    def gather(self) -> dict[int, dict[str, Any] | float]:
        """Every rank's snapshot; for a rank that did not answer in time, the seconds since
        rank 0 last heard from it."""
        self.seq += 1
        seq = self.seq
        for r in range(1, self.size):
            self.sends.append(self.comm.isend(seq, dest=r, tag=_TAG_REQUEST))
        got: dict[int, dict[str, Any] | float] = {0: self.snapshot(seq)}
        status = self.MPI.Status()
        deadline = time.monotonic() + self.answer_within
        while len(got) < self.size and time.monotonic() < deadline:
            while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=_TAG_REPORT, status=status):
                answer = self.comm.recv(source=status.Get_source(), tag=_TAG_REPORT)
                if answer["seq"] == seq:
                    got[answer["rank"]] = answer
            time.sleep(0.02)
        now = time.monotonic()
        for r in range(self.size):
            got.setdefault(r, now - float(self.heard[r]))
        return got


# -- the report ---------------------------------------------------------------------------


def _behind(entry: dict[str, Any] | float) -> bool:
    return not isinstance(entry, dict) or entry["exited"] is not None or entry["waiting"] is None


def render(
    got: dict[int, dict[str, Any] | float],
    stalled: float,
    warn: float,
    abort: float | None,
    *,
    aborting: bool,
) -> str:
    """The stall report, as rank 0 prints it: the ranks behind first."""
    size = len(got)
    behind = [r for r in sorted(got) if _behind(got[r])]
    if not behind:  # every rank waits: those that made the least progress wait elsewhere
        counts = {r: e["count"] for r, e in got.items() if isinstance(e, dict)}
        if len(set(counts.values())) > 1:
            behind = [r for r in sorted(counts) if counts[r] == min(counts.values())]
    others = [r for r in sorted(got) if r not in behind]
    named = ", ".join(map(str, behind)) if behind else "none found (every rank waits in jaxddp)"
    lines = [
        "",
        (
            f"==== jaxddp stall report: no rank has made progress for {stalled:.0f} s "
            f"(JAXDDP_STALL_WARN={warn:g}); {size} ranks; behind: {named} ===="
        ),
    ]
    for r in behind + others:
        entry = got[r]
        if not isinstance(entry, dict):
            lines.append(
                f"rank {r}: DID NOT ANSWER (exited, killed, or blocked where Python cannot "
                f"run); last heard from {entry:.0f} s ago"
            )
            continue
        progress = f"progress {entry['count']} ({entry['label']}), last {entry['since']:.0f} s ago"
        if entry["exited"] is not None:
            seconds, how = entry["exited"]
            state = f"EXITED {seconds:.0f} s ago ({how}), the others may wait for it"
        elif entry["waiting"] is not None:
            state = f"{'BEHIND, ' if r in behind else ''}waiting in {entry['waiting']}"
        else:
            state = "BEHIND: not in jaxddp, nor in a compiled step"
        lines.append(f"rank {r}: {state}; {progress}")
        if entry["exited"] is None:
            for i, frame in enumerate(entry["user"]):
                lines.append(f"    {'at' if i == 0 else '  '} {frame}")
            if entry["inner"] is not None:
                lines.append(f"       (innermost, folded: {entry['inner']})")
    if aborting:
        lines.append(
            f"jaxddp: no progress for {stalled:.0f} s (JAXDDP_STALL_ABORT={abort:g}): "
            "aborting every rank with MPI_Abort."
        )
    else:
        lines.append(
            "(repeats at most every JAXDDP_STALL_WARN s; JAXDDP_STALL_ABORT=<seconds> ends a "
            "stalled job; see 'When a job hangs' in jaxddp's docs)"
        )
    return "\n".join(lines) + "\n"
