"""Start-up and the MPI world: the guard, ``MPI_Init``, rank and size, private communicators.

``import jaxddp`` calls :func:`start`: the launcher guard runs before ``MPI_Init``, then MPI is
initialized right away, as ``from mpi4py import MPI`` would, so the program's own mpi4py
code works. A program that set ``mpi4py.rc.initialize = False`` keeps control: MPI is then
initialized by the first jaxddp call that needs it (:func:`init`). What jaxddp learns of the
world (ranks, node-local ranks, its private communicators) is computed once, on first use.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from types import ModuleType
from typing import Any

from .. import _native
from .._base import exit as _exit
from .._base import mpi as _mpi
from .._base import settings as _settings
from .._base import streams as _streams
from .._types import Communicator
from . import distributed as _distributed
from . import gpus as _gpus
from . import launcher as _launcher
from . import watchdog as _watchdog
from .agreement import agree_settings

__all__ = [
    "World",
    "check_comm",
    "in_loader_worker",
    "init",
    "jax_comm",
    "local_rank",
    "mpi",
    "mpi4jax",
    "private_comms",
    "py_comm",
    "rank",
    "start",
    "world_size",
]

_lock = threading.RLock()
_world: World | None = None


def mpi() -> ModuleType:
    """``mpi4py.MPI``, loaded without initializing MPI if nobody loaded it yet."""
    return _mpi.load()


def _cli_is_starting() -> bool:
    """True while ``jaxddp doctor`` (the console script or ``python -m jaxddp``) imports jaxddp.

    Python imports the package before any code of its CLI can run, so the interpreter's own
    command line (``sys.orig_argv``, which neither runpy nor a console script rewrites) is
    the only witness. The doctor runs the guard itself and reports a mismatch instead of
    dying of it; it starts MPI only when the launcher matches.
    """
    argv = list(getattr(sys, "orig_argv", ()))
    for i, arg in enumerate(argv[1:-1], start=1):
        if arg == "-m" and argv[i + 1] == "jaxddp":
            return True
    return len(argv) > 1 and os.path.basename(argv[1]) in ("jaxddp", "jaxddp.exe")


def in_loader_worker() -> bool:
    """True in a process that ``multiprocessing`` started by spawn or forkserver from a rank
    of a launched job: a data-loading worker (grain's ``mp_prefetch``, a PyTorch DataLoader
    with the spawn context) that imports jaxddp while unpickling its work.

    Such a process inherits the launcher's variables but not its connection to the launcher
    (``PMI_FD`` names a descriptor it does not have), so ``MPI_Init`` there aborts, and the
    pool starts the worker again, forever. jaxddp leaves MPI alone in it instead.
    """
    import multiprocessing

    child = multiprocessing.parent_process() is not None
    # while a spawned child unpickles its work, before parent_process() is set
    child = child or bool(getattr(multiprocessing.current_process(), "_inheriting", False))
    return child and _launcher.kinds.detect(os.environ).kind is not _launcher.Kind.NONE


def start() -> None:
    """What ``import jaxddp`` does: the guard before ``MPI_Init``, then ``MPI_Init``.

    When the program initialized MPI itself first, only the silent-singleton check runs;
    when it asked mpi4py not to initialize, MPI stays uninitialized until first use. In a
    data-loading worker (:func:`in_loader_worker`) nothing starts.
    """
    if _cli_is_starting() or in_loader_worker():
        return
    MPI = _mpi.load()
    if not MPI.Is_initialized():
        _launcher.guard(MPI)
        if _mpi.program_initializes():
            return
        with _watchdog.startup_guard():
            _mpi.initialize()
    size = MPI.COMM_WORLD.Get_size()
    _launcher.check_world_size(size)
    if size > 1:
        _streams.line_buffered()  # a rank's printed lines must outlive an abort
    _watchdog.start(MPI)
    _gpus.assign(MPI)  # before JAX starts: each rank's GPU
    if _settings.collectives() == "xla":
        init()  # JAX's distributed runtime too, before the program's first JAX computation


class World:
    """What :func:`init` learned about the MPI world, computed once."""

    def __init__(self, MPI: ModuleType) -> None:
        world = MPI.COMM_WORLD
        agree_settings(world)  # before any collective: settings that change what they send
        self.rank: int = world.Get_rank()
        self.size: int = world.Get_size()
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = node.Get_rank()
        self.local_size: int = node.Get_size()
        self.node_ranks: tuple[int, ...] = tuple(node.allgather(self.rank))  # in rank order
        node.Free()
        # Two private communicators: one for mpi4py calls made from Python, one for mpi4jax
        # calls made from compiled code. Sharing one between the two can mix up messages.
        self.py_comm = world.Clone()
        self.jax_comm = world.Clone()
        _native.agree(MPI, world)  # the handler of jitted allreduces, the same on every rank
        _native.share(MPI, self.jax_comm, one_node=self.local_size == self.size)


def init() -> World:
    """Initializes MPI once (after the launcher guard) and returns what it learned.

    Safe to call many times. Every rank must reach it, as every rank must reach ``MPI_Init``.
    """
    global _world
    if _world is not None:
        return _world
    with _lock:
        if _world is None:
            MPI = _mpi.load()
            if not MPI.Is_initialized() and in_loader_worker():
                msg = (
                    "jaxddp's MPI world is not available in a data-loading worker process "
                    f"(pid {os.getpid()}, started by multiprocessing from a rank of an MPI "
                    "job): MPI cannot start there. Call jaxddp's collectives, "
                    "DistributedSampler and jaxddp.rank() in the training process, and "
                    "pass workers what they need (indices, rank) as plain values."
                )
                raise RuntimeError(msg)
            if not MPI.Is_initialized():
                _launcher.guard(MPI)
                with _watchdog.startup_guard():
                    _mpi.initialize()
            _watchdog.start(MPI)
            _gpus.assign(MPI)
            world = World(MPI)
            _launcher.check_world_size(world.size)
            if world.size > 1:
                _streams.line_buffered()
            _install_abort_on_error(world)
            # agreed on every rank by World(); `jaxddp doctor` looks at JAX's devices first
            if _settings.collectives() == "xla" and not _cli_is_starting():
                _distributed.start(
                    world.py_comm, world.rank, world.size, one_node=world.local_size == world.size
                )
            _world = world
    return _world


def rank() -> int:
    """This process's rank in the MPI world (0 without a launcher)."""
    return init().rank


def world_size() -> int:
    """The number of ranks in the MPI world (1 without a launcher)."""
    return init().size


def local_rank() -> int:
    """This process's rank among the ranks on the same node (useful to pick a GPU)."""
    return init().local_rank


def py_comm() -> Any:
    """jaxddp's private communicator for mpi4py calls made from Python."""
    return init().py_comm


def jax_comm() -> Any:
    """jaxddp's private communicator for mpi4jax calls made from compiled code."""
    return init().jax_comm


def mpi4jax() -> ModuleType:
    """Imports mpi4jax, after MPI has been initialized by :func:`init`."""
    init()
    import mpi4jax as m

    return m


_keyval: int | None = None


def private_comms(comm: Any = None) -> tuple[Any, Any]:
    """jaxddp's two communicators over ``comm``: for mpi4py calls made from Python (checks,
    collectives on concrete values), and for compiled code.

    ``None``: jaxddp's private clones of ``COMM_WORLD``. A user's communicator: two private
    duplicates of it, made once (collectively, at the first use on it) and cached on the
    communicator as an MPI attribute, so that jaxddp's traffic never shares a communicator
    with the user's own calls, nor Python's with compiled code still running.
    """
    global _keyval
    world = init()
    if comm is None:
        return world.py_comm, world.jax_comm
    with _lock:
        if _keyval is None:
            _keyval = mpi().Comm.Create_keyval()
    private = comm.Get_attr(_keyval)
    if private is None:
        private = (comm.Dup(), comm.Dup())
        comm.Set_attr(_keyval, private)
    return private


def check_comm(comm: Communicator | None = None) -> Any:
    """The communicator for jaxddp's own mpi4py traffic (checks) over ``comm``."""
    return private_comms(comm)[0]


def _install_abort_on_error(world: World) -> None:
    """Makes an uncaught exception on one rank end the whole job instead of hanging it.

    Without this, the other ranks wait forever in their next collective. The rank's
    traceback is printed first; ``JAXDDP_ABORT_ON_ERROR=0`` leaves ``sys.excepthook`` alone.
    """
    if world.size == 1 or not _settings.abort_on_error():
        return
    previous = sys.excepthook

    def abort_on_error(exc_type: Any, exc: Any, tb: Any) -> None:
        previous(exc_type, exc, tb)
        _watchdog.abort_job(
            1,
            f"jaxddp: rank {world.rank} of {world.size} raised an uncaught exception; "
            "aborting every rank with MPI_Abort so that none waits forever "
            "(set JAXDDP_ABORT_ON_ERROR=0 to turn this off).\n",
        )

    sys.excepthook = abort_on_error
    _exit.install()
    atexit.register(_abort_on_exit_status, world)


def _abort_on_exit_status(world: World) -> None:
    """At exit: a rank that called ``sys.exit`` with a failure ends the job, as an uncaught
    exception does (MPI would otherwise finalize it and leave the others waiting)."""
    _streams.flush()  # another rank may abort the job while this one finalizes
    status = _exit.nonzero()
    if status is None:
        return
    _watchdog.abort_job(
        status,
        f"jaxddp: rank {world.rank} of {world.size} called sys.exit({_exit.status!r}) at "
        f"{_exit.where}; aborting every rank with MPI_Abort so that none waits forever "
        "(set JAXDDP_ABORT_ON_ERROR=0 to turn this off).\n",
    )
