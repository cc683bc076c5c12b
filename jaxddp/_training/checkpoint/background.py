"""A save in flight: the host copy it writes, the thread that compares and writes it, and
its outcome.

The state is copied to host memory on the calling thread, before ``save`` returns, so that
what is compared and written is what was passed, whatever the loop does to its arrays
afterwards (a donated buffer, an in-place update). The work (every rank: the comparison of
the ranks' copies; the writer: then the write) runs on a daemon thread, which drops the
copy when it ends: the manager's next call, or :func:`settle_at_exit`, waits for it. While it runs, a second thread counts its
progress (the bytes in the checkpoint directory's temporary folders growing) for the stall
inspector, so a rank waiting for a long write that moves is not reported, and one waiting
for a write that stopped is.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..._base import exit as _exit
from ..._base import progress as _progress
from ..._runtime import watchdog as _watchdog

__all__ = ["HostCopy", "Write", "host_copy", "in_flight", "settle_at_exit", "settled"]

LOOK = 1.0  # seconds between two looks at the write's progress
_NO_THREADS = "can't create new thread at interpreter shutdown"  # Python 3.12's words


class HostCopy(np.ndarray):
    """An array of a save's own host copy: nothing else holds it, and nothing writes it
    until the save is settled. Orbax deep-copies every host array it is given before it
    writes (a guard against the caller changing it meanwhile): for these it is the array
    itself, not a second copy of the whole state (for 92 MB, 135 ms of the write's
    300 ms of CPU)."""

    def __deepcopy__(self, memo: Any) -> HostCopy:
        return self


def _leaf_copy(leaf: Any, into: Any = None) -> Any:
    if isinstance(leaf, jax.Array):
        host = np.asarray(leaf)  # a GPU's array: a fresh host copy; a CPU's: XLA's buffer
        on_cpu = all(device.platform == "cpu" for device in leaf.devices())
        return _copy(host, into) if on_cpu else host.view(HostCopy)
    if isinstance(leaf, np.ndarray):
        return _copy(leaf, into)
    return leaf  # Python numbers, NumPy scalars: immutable


def _copy(array: np.ndarray, into: Any) -> np.ndarray:
    """``array`` copied into ``into`` where that is an array of its shape and dtype, else
    into new memory."""
    if (
        isinstance(into, np.ndarray)
        and into.shape == array.shape
        and into.dtype == array.dtype
        and into.flags.writeable
    ):
        np.copyto(into, array)
        return into if isinstance(into, HostCopy) else into.view(HostCopy)
    return array.copy().view(HostCopy)


def host_copy(tree: Any, into: Any = None) -> Any:
    """``tree`` with every array leaf copied into host memory of its own.

    ``into``: an earlier copy of a tree of the same structure (or None), whose arrays
    nothing uses any more: each array of the same shape and dtype is copied into its
    buffer. A copy into fresh memory also pays for the kernel's zeroing of every new page,
    about as long as the copy itself."""
    tree_util = jax.tree_util
    if into is not None and tree_util.tree_structure(into) == tree_util.tree_structure(tree):
        return tree_util.tree_map(_leaf_copy, tree, into)
    return tree_util.tree_map(_leaf_copy, tree)


class Write:
    """One save's write, on a thread of its own; :meth:`wait` returns its error, if any, as
    ``(kind, text)`` where ``kind`` names the type to raise (see the manager's ``_ERRORS``).
    ``watch``: the checkpoint directory on the rank that writes; None on a rank whose
    thread only compares its copy with the others' (nothing to watch).

    A second thread looks at the write's temporary folders once a second and counts each
    change as progress for the stall inspector; it ends as soon as the write does, and
    :meth:`wait` joins both. The waiting thread itself blocks in one
    ``join``: a wait that polled would look like progress, and a write that stopped would
    never be reported."""

    def __init__(self, step: int, work: Callable[[], None], watch: str | None,
                 kind: Callable[[BaseException], str]) -> None:  # fmt: skip
        self.step = step
        self.error: tuple[str, str] | None = None
        self._work: Callable[[], None] | None = work
        self._watch, self._kind = watch, kind
        self._finished = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"jaxddp checkpoint {step}", daemon=True
        )
        self._counter = threading.Thread(
            target=self._count_progress, name=f"jaxddp checkpoint {step} progress", daemon=True
        )
        self._thread.start()
        if watch is not None:
            self._counter.start()

    def _run(self) -> None:
        try:
            if self._work is not None:
                self._work()
        except BaseException as e:  # noqa: BLE001 - reported by wait(), on every rank
            # an error whose message is whole (``as_is``: it names the step and the
            # ranks itself) is raised as it is; any other names its type
            text = str(e) if getattr(e, "as_is", False) else f"{type(e).__name__}: {e}"
            self.error = (self._kind(e), text)
        finally:
            self._work = None  # what it held (the host copy) is freed now, not at the wait
            self._finished.set()

    def _count_progress(self) -> None:
        watch = self._watch
        if watch is None:
            return
        seen = _bytes_under(watch)
        while not self._finished.wait(LOOK):
            now = _bytes_under(watch)
            if now != seen:
                seen = now
                _progress.note(f"writing checkpoint {self.step}")

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> tuple[str, str] | None:
        """Waits for the write to end, and for the thread counting its progress, which ends
        at most one look later; returns the write's error, if any. Neither thread is left
        running once a save is settled."""
        self._thread.join()
        if self._counter.ident is not None:
            self._counter.join()
        return self.error


def _bytes_under(folder: str) -> tuple[int, int]:
    """(files, bytes) in the temporary folders of ``folder`` (Orbax's
    ``<step>.orbax-checkpoint-tmp-*``, jaxddp's ``*.tmp``): they grow while a write moves,
    and the complete checkpoints beside them are not walked."""
    files = size = 0
    temporaries: list[str] = []
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        temporaries = [e.path for e in entries if "tmp" in e.name]
    for temporary in temporaries:
        for root, _, names in os.walk(temporary):
            for name in names:
                with contextlib.suppress(OSError):
                    size += os.stat(os.path.join(root, name)).st_size
                    files += 1
    return files, size


# -- at exit: a save still in flight is waited for, and its error reported --------------

_in_flight: list[Any] = []  # managers with a save in flight, in the order of their saves
_registered = False


def in_flight(manager: Any) -> None:
    """Has :func:`settle_at_exit` wait for ``manager``'s save if it is still in flight at
    exit. The handler runs where ``concurrent.futures`` stops taking work (the first thing
    Python's shutdown does: Orbax and the checksums need its threads), so before it: in
    ``threading``'s own exit hooks, which run last registered first; and so before every
    ``atexit`` handler (jaxddp's world's, mpi4py's ``MPI_Finalize``)."""
    global _registered
    if not _registered:
        register = getattr(threading, "_register_atexit", atexit.register)
        register(settle_at_exit)
        _registered = True
    if manager not in _in_flight:
        _in_flight.append(manager)


def settled(manager: Any) -> None:
    with contextlib.suppress(ValueError):
        _in_flight.remove(manager)


def settle_at_exit() -> None:
    """Waits for every manager's save still in flight. On a normal exit every rank learns
    its outcome (a collective, in the order the saves were made, the same on every rank); a
    failed save is printed on every rank and ends the job with status 1. A rank leaving
    with an error only waits for its own write: jaxddp's fail-fast abort ends the others."""
    failing = _exit.nonzero() is not None or getattr(sys, "last_value", None) is not None
    for manager in _in_flight:
        if failing:
            manager._wait_alone()
            continue
        try:
            manager._settle()
        except Exception as e:  # noqa: BLE001 - a failed save at exit ends the job
            why = f"jaxddp: {type(e).__name__}: {e}\n"
            if _NO_THREADS in str(e):  # Python 3.12: no thread starts once the exit began
                why += (
                    "The save was still being written when the program ended, and this Python "
                    "starts no new thread then: it is not saved (the checkpoints before it are "
                    "intact). Call the manager's close() or wait_until_finished() before the "
                    "program ends (a `with` block does).\n"
                )
            _watchdog.abort_job(1, why + "Ending the job with status 1.\n")
