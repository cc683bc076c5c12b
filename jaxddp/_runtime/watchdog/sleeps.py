"""What the main thread's sleeps tell the stall inspector (Linux's ``/proc/self/task/<tid>/``).

A loop of jitted steps runs no Python that the inspector could count, but its main thread
sleeps and wakes once per step (a futex: it waits for the step's result, and the result
comes), so waking counts as progress. An MPI that sleeps while it waits in a collective
(MPICH with ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``: a ``clock_nanosleep`` on every turn of its
polling loop) wakes thousands of times a second without any progress at all. The two differ
in how the thread sleeps: :meth:`MainSleeps.polling` tells them apart.
"""

from __future__ import annotations

import platform
import time

# Linux's numbers for nanosleep and clock_nanosleep, per machine; elsewhere no sleep is
# taken for a polling one (every wake counts, as before this check existed)
_NANOSLEEPS = {
    "x86_64": {"35", "230"},
    "aarch64": {"101", "115"},
    "arm64": {"101", "115"},
    "ppc64le": {"162", "348"},
}
# At most this many wakes per second come from a loop's own sleeps (a step's result, a
# data loader's reads); an MPI that sleeps in its waits wakes thousands of times a second.
POLLING_WAKES_PER_SECOND = 200
LOOKS = 20  # looks at what the thread is doing, a millisecond apart, before it counts as awake


class MainSleeps:
    """The main thread's voluntary sleeps: how many (:meth:`count`), and whether it sleeps
    the way a polling MPI does (:meth:`polling`). 0 and False where Linux does not tell."""

    def __init__(self, native_id: int | None) -> None:
        task = None if native_id is None else f"/proc/self/task/{native_id}"
        self.status: str | None = None if task is None else f"{task}/status"
        self.syscall: str | None = None if task is None else f"{task}/syscall"
        self.nanosleeps = _NANOSLEEPS.get(platform.machine(), set())

    def count(self) -> int:
        """How often the thread has given up the CPU to wait (its voluntary context
        switches)."""
        if self.status is None:
            return 0
        try:
            with open(self.status) as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        self.status = None  # the main thread has ended, or no /proc
        return 0

    def polling(self, wakes: int, seconds: float) -> bool:
        """Whether ``wakes`` wakes in ``seconds`` are a wait that sleeps in short turns
        rather than progress: more than :data:`POLLING_WAKES_PER_SECOND`, and the thread
        found in a ``nanosleep`` within :data:`LOOKS` looks (a thread that waits for a step's
        result sleeps in a futex instead)."""
        if wakes <= POLLING_WAKES_PER_SECOND * seconds or not self.nanosleeps:
            return False
        for _ in range(LOOKS):
            if self._in_nanosleep():
                return True
            if self.syscall is None:
                return False
            time.sleep(0.001)
        return False

    def _in_nanosleep(self) -> bool:
        if self.syscall is None:
            return False
        try:
            with open(self.syscall) as f:
                number = f.read().split(maxsplit=1)[0]
        except (OSError, IndexError):
            self.syscall = None  # no /proc/<tid>/syscall here (or the thread has ended)
            return False
        return number in self.nanosleeps
