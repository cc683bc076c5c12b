"""What the ranks say at each step of :func:`jaxddp.join`, and how it travels."""

from __future__ import annotations

import time
from typing import Any

from ..._collectives.consistency import TreeMismatchError
from .batches import StreamError

__all__ = ["BATCH", "ENDED", "FAILED", "KINDS", "abandoned", "error_payload", "wait", "wire"]

# What each rank says of a step, one byte per rank.
ENDED, BATCH, FAILED = 0, 1, 2

KINDS: dict[str, type[Exception]] = {
    "TreeMismatchError": TreeMismatchError,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


def error_payload(problem: BaseException) -> tuple[str, str, bool]:
    """What the other ranks learn of this rank's failure: its type, text, and whether it
    is one of jaxddp's checks (raised as the same type everywhere)."""
    if isinstance(problem, StreamError):
        return problem.kind.__name__, str(problem), True
    return type(problem).__name__, str(problem), False


def wait(request: Any) -> None:
    """Waits for a step's bytes without spinning. They are almost always there already (in
    13 and 7 of 200 steps of the step benchmark, at 2 ranks, they were not: a rank's Python
    runs ahead of its dispatched steps); when not, MPI's own wait would poll on a core that
    the ranks' compiled steps, still running, may need."""
    pause = 1e-5
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


_wires: dict[int, tuple[Any, Any]] = {}
abandoned: list[Any] = []  # bytes in flight of loops left early, kept with their buffers


def wire(check: Any) -> Any:
    """The communicator of the per-step bytes over ``check``'s ranks: a duplicate made at
    the first step of the first join on it (a collective point), so that they never
    interleave with other traffic."""
    found = _wires.get(id(check))
    if found is None:
        found = _wires[id(check)] = (check, check.Dup())
    return found[1]
