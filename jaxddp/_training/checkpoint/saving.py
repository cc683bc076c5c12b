"""A save's host copy, its background work (compare the ranks' copies, then write) and the
outcomes its error travels as to every rank (:class:`.manager.CheckpointManager`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._runtime import world as _world
from ..._types import Communicator
from . import background as _background
from . import replicated
from .steps import remove_leftovers, write_step
from .trees import DamagedCheckpointError

__all__ = ["COLLECTIVE", "ERRORS", "REFUSED", "compare_then_write", "host_copy", "kind_of",
           "threads_may_talk", "writing"]  # fmt: skip


COLLECTIVE = (
    "Every method of jaxddp.CheckpointManager is a collective (the first rank writes, and "
    "every rank learns the outcome): call it on every rank, not under `if rank == 0:`."
)


def host_copy(comm: Communicator, compare_comm: Any, tree: Any, *, writer: bool,
              background: bool, spare: Any, step: int, doing: str) -> tuple[Any, Any, Any]:  # fmt: skip
    """``(host, held, spare)``. Without ``compare_comm`` the ranks' states are compared here,
    before anything is written (refused on every rank where they differ), and the writer
    holds its host copy (``host``); with it, every rank copies its state to host memory and
    returns (``held``), compared on the save's own thread before the writer writes."""
    if compare_comm is None:
        copy = writer and background
        host = replicated.same_on_every_rank(
            comm, tree, step=step, doing=doing, copy=copy, into=spare
        )
        return host, None, host if copy else None
    held = replicated.hold(tree, copy=True, into=spare)
    return None, held, held[0] if held[1] is None else None


def writing(compare_comm: Any, host: Any, held: Any, *, step: int, doing: str, directory: str,
            write: tuple[Any, dict[str, Any]] | None) -> _background.Write | None:  # fmt: skip
    """The save's background work on this rank (None: a rank with nothing to do)."""
    if held is None:
        if write is None:
            return None
        manager, entry = write
        return _background.Write(
            step, lambda: write_step(manager, step, host, entry), directory, kind_of
        )
    assert compare_comm is not None  # held is made only with a comm to compare on
    work = compare_then_write(compare_comm, held, step, doing, write)
    return _background.Write(step, work, directory if write is not None else None, kind_of)


def threads_may_talk() -> bool:
    """Whether MPI lets a thread other than the main one make calls beside it."""
    MPI = _world.mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def compare_then_write(comm: Communicator, held: tuple[Any, replicated.Refusal | None],
                        step: int, doing: str, write: tuple[Any, dict[str, Any]] | None,
                        ) -> Callable[[], None]:  # fmt: skip
    """The work of a background save's thread on every rank: compare this rank's host copy
    with the others' (a collective on ``comm``, which this save alone uses), then, on the
    writer (``write``: Orbax's manager and the step's metadata entry), write it. A refusal
    writes nothing (and removes the step's slices, written before) and is raised by the
    manager's next call on every rank, as the writer's error."""
    box = [held]  # emptied once compared: a rank that does not write frees its copy then

    def work() -> None:
        host, error = box.pop()
        refusal = replicated.compare(comm, host, error, step=step, doing=doing)
        if write is None:
            return  # the writer, which compared the same, reports the outcome
        manager, entry = write
        if refusal is not None:
            remove_leftovers(manager)  # the slices of a step that Orbax will never list
            raise replicated.Refused(*refusal)
        write_step(manager, step, host, entry)

    return work


def kind_of(error: BaseException) -> str:
    if isinstance(error, replicated.Refused):
        return f"refused {error.kind.__name__}"
    if isinstance(error, DamagedCheckpointError):
        return "damaged"
    return "invalid" if isinstance(error, ValueError) else "other"


REFUSED: dict[str, type[Exception]] = {
    f"refused {kind.__name__}": kind for kind in (ValueError, TimeoutError, RuntimeError)
}  # a background save's comparison, raised with its message as it is

ERRORS: dict[str, type[Exception]] = {
    "damaged": DamagedCheckpointError,
    "invalid": ValueError,
    "other": RuntimeError,
}
