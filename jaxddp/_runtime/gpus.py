"""Which GPU each rank computes on, chosen at ``import jaxddp`` before JAX starts.

Left alone, every process JAX starts on a node with several GPUs takes all of them, the
first as its default device, and preallocates 75% of each one's memory: the ranks of a node
pile onto GPU 0 and the second rank runs out of memory. So where JAX has a CUDA plugin and
``JAXDDP_GPUS`` is ``auto`` (the default), :func:`assign` (collective over the world, right
after ``MPI_Init``) gives each rank one GPU: the ranks of a node take the GPUs they see in
turn, by node-local rank (``jax_cuda_visible_devices``), and a rank that sees one GPU only
(Slurm's ``--gpus-per-task=1``, ``CUDA_VISIBLE_DEVICES`` set per rank) keeps it. Where
several ranks end up on one GPU (more ranks than GPUs), their JAX does not preallocate
(``XLA_PYTHON_CLIENT_PREALLOCATE=false``) unless the program chose a memory setting itself.
GPUs are told apart by PCI bus id, which is the same whatever ``CUDA_VISIBLE_DEVICES`` a
rank has. :func:`assignment` says what was done (``jaxddp doctor`` prints it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from .._base import cuda as _cuda
from .._base import settings as _settings

__all__ = ["Assignment", "assign", "assignment"]

# The program's own choice of how JAX takes GPU memory: where one is set, jaxddp leaves it.
MEMORY_VARIABLES = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                    "XLA_PYTHON_CLIENT_ALLOCATOR")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The GPU a rank was given: what it saw (PCI bus ids, in CUDA's order), the CUDA
    ordinal it uses (None: no choice made), the world ranks of its node on the same GPU,
    what jaxddp set for it, and why."""

    seen: tuple[str, ...] = ()
    ordinal: int | None = None
    sharing: tuple[int, ...] = ()
    changes: tuple[str, ...] = ()
    why: str = ""
    rank: int = -1  # this rank, as numbered in `sharing`

    def describe(self) -> str:
        """One line for ``jaxddp doctor``."""
        if self.ordinal is None:
            return self.why
        others = [str(r) for r in self.sharing if r != self.rank]
        shared = (
            f", shared with rank{'s' * (len(others) > 1)} {', '.join(others)}" if others else ""
        )
        done = f"; jaxddp set {', '.join(self.changes)}" if self.changes else ""
        return f"GPU {self.ordinal} ({self.seen[self.ordinal]}: {self.why}){shared}{done}"


_assignment: Assignment | None = None


def assignment() -> Assignment:
    """What :func:`assign` did on this rank (nothing yet: an empty Assignment)."""
    return _assignment or Assignment(why="not chosen (jaxddp's GPU choice has not run)")


def _choose(seen: list[str], local_rank: int) -> int:
    """The ordinal a rank takes among the GPUs it sees: its own where it sees one only."""
    return local_rank % len(seen)


def assign(MPI: Any) -> None:
    """Collective over ``MPI.COMM_WORLD`` where JAX may use CUDA: gives this rank its GPU
    (see the module's doc). Elsewhere, and with ``JAXDDP_GPUS=off``, it does nothing."""
    global _assignment
    if _assignment is not None:
        return
    if _cuda.jax_may_use_cuda() is None:
        _assignment = Assignment(why="no GPU for JAX here (no CUDA plugin, or JAX_PLATFORMS)")
        return
    if not _settings.gpus():
        _assignment = Assignment(why=f"{_settings.GPUS.name}=off: JAX chooses the devices")
        return
    try:
        seen, problem = _cuda.devices(), ""
    except _cuda.CudaError as error:
        seen, problem = [], str(error)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank = node.Get_rank()
    mine = seen[_choose(seen, local_rank)] if seen else None
    everyone = node.allgather((rank, mine))
    node.Free()
    if not seen:
        _assignment = Assignment(why=f"no GPU is visible to this rank ({problem or 'none'})")
        return
    ordinal = _choose(seen, local_rank)
    sharing = tuple(r for r, bus in everyone if bus == mine)
    changes = []
    if len(seen) > 1:
        chosen = jax.config.values.get("jax_cuda_visible_devices", "all")
        if chosen == "all":
            jax.config.update("jax_cuda_visible_devices", str(ordinal))
            changes.append(f"jax_cuda_visible_devices={ordinal}")
        else:  # the program chose before importing jaxddp: its choice stands
            ordinal = int(str(chosen).split(",")[0])
    if len(sharing) > 1 and not any(os.environ.get(v) for v in MEMORY_VARIABLES):
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        changes.append("XLA_PYTHON_CLIENT_PREALLOCATE=false")
    if len(seen) == 1:
        why = "the one GPU this rank sees"
    else:
        why = f"of {len(seen)}, by node-local rank {local_rank}"
    _assignment = Assignment(tuple(seen), ordinal, sharing, tuple(changes), why, rank)
