"""Progress counting for the stall inspector: one counter per process; a leaf module.

Drawing a batch from a :class:`~jaxddp.DistributedSampler`, calling a jaxddp collective from
Python and :func:`heartbeat` each add one to :data:`count` and say what moved in
:data:`label`. The watchdog thread (:mod:`jaxddp._runtime.watchdog`) only reads them, once a second,
so counting costs one integer addition and one assignment: no lock, no clock. A count lost
to a race between two threads does not matter; any change is progress.
"""

from __future__ import annotations

import threading

__all__ = ["count", "heartbeat", "label", "note"]

count = 0
label = "start-up"
main_count = 0  # the main thread's share of count (see jaxddp._base.exit)
_MAIN = threading.main_thread().ident


def note(what: str) -> None:
    """Counts one unit of progress, described by ``what``."""
    global count, label, main_count
    count += 1
    label = what
    if threading.get_ident() == _MAIN:
        main_count += 1


def heartbeat(label: str | None = None) -> None:
    """Tells jaxddp's stall inspector that this rank is making progress.

    Batches drawn from :class:`DistributedSampler`, jaxddp collectives called from Python
    and a main thread seen working (a loop of jitted steps) count as progress already; a rank
    that waits long in one place for a reason of its own (a slow file system, a long
    evaluation on one rank) calls this once in a while, so that the stall inspector
    (``JAXDDP_STALL_WARN``, ``JAXDDP_STALL_ABORT``) does not report it as stalled. It costs
    well under a microsecond and communicates nothing.

    Args:
      label: what this rank is doing, shown in a stall report (``"epoch 3, batch 120"``);
        ``None`` keeps ``"heartbeat"``.

    Example:
      >>> import jaxddp
      >>> for shard in range(3):  # a loop with its own data loading
      ...     jaxddp.heartbeat(f"shard {shard}")
    """
    note("heartbeat" if label is None else str(label))
