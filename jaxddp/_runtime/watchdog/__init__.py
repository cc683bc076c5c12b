"""The stall inspector: a thread on every rank that names the ranks behind when a job hangs.

Started with MPI (:func:`start`, at ``import jaxddp``), on a communicator of its own (a
duplicate of ``COMM_WORLD``), it talks point to point with rank 0 once a second, without
ever blocking: every rank sends rank 0 its progress count (:mod:`jaxddp._base.progress`), and
rank 0 decides. After ``JAXDDP_STALL_WARN`` seconds with no progress on any rank, rank 0 asks
every rank for a snapshot (progress, label, seconds since its last progress, its main
thread's stack) and prints one report, the ranks behind first; a rank that does not answer
within a few seconds is named as such. After ``JAXDDP_STALL_ABORT`` seconds it prints the
report and calls ``MPI_Abort``. Rank 1 stands in for a rank 0 whose Python threads cannot
run (its main thread holding the GIL in C code): it names rank 0 and aborts itself. Before
any abort, every rank the aborting one can reach holds its stdout and stderr (what it
printed is written, later writes wait for the abort) and waits until the launcher has read
them (:func:`abort_job`).

At exit every rank keeps its watchdog running until all ranks have reached their exit (a
nonblocking barrier on the watchdog's communicator): a rank that left the loop early is then
shown as exited, with the line of its ``sys.exit``, while the others hang in a collective.

Before ``MPI_Init`` (:func:`startup_guard`): a rank that dies before starting MPI leaves the
others in ``MPI_Init`` forever, holding the GIL, where no Python thread can run. A small
watcher process is started beside each rank that expects a world of more than one; if
``MPI_Init`` has not returned after ``JAXDDP_STALL_ABORT`` (or ``JAXDDP_STARTUP_TIMEOUT``)
seconds, it prints why and kills the rank.
"""

from .report import render
from .stacks import folded_stack
from .startup import startup_guard
from .thread import abort_job, start

__all__ = ["abort_job", "folded_stack", "render", "start", "startup_guard"]
