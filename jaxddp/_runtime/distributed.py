"""JAX's distributed runtime, started from jaxddp's MPI world (``JAXDDP_COLLECTIVES=xla``).

JAX finds its processes by guessing the cluster from the environment (Slurm, Open MPI 4 or 5,
a few clouds); under MPICH's hydra it finds nothing and every process trains alone. jaxddp
already has the world, checked by the launcher guard, so it tells JAX: rank 0 picks a free
port, the address travels to every rank over MPI, and each rank starts as process ``rank``
of ``size``, with the device jaxddp gave it (``JAXDDP_GPUS``). On CPUs the processes' XLA
collectives go through gloo. :func:`mesh` is the ranks' one-axis mesh, one device per rank in
rank order, that ``jaxddp.spmd`` maps a step over.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._base import settings as _settings
from . import gpus as _gpus

__all__ = ["backends_started", "mesh", "start", "started"]

_started = False
_mesh: Any = None


def started() -> bool:
    """Whether this process runs JAX's distributed runtime as a rank of jaxddp's world."""
    return _started


def _never() -> bool:
    return False


# Whether JAX has made its devices already (after that, distributed start is refused). It
# reads a JAX internal, so it lives with the others (jaxddp._collectives._jax.compat), and
# `import jaxddp` sets it here before the world starts.
backends_started: Callable[[], bool] = _never


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def start(comm: Any, rank: int, size: int, *, one_node: bool) -> None:
    """Starts JAX's distributed runtime as process ``rank`` of ``size`` (collective over
    ``comm``, the world). Raises RuntimeError on every rank where some rank's JAX has
    already made its devices, naming those ranks."""
    global _started
    if _started or size == 1:
        return
    late = comm.allgather(backends_started())
    if any(late):
        ranks = ", ".join(str(r) for r, was in enumerate(late) if was)
        msg = (
            f"JAXDDP_COLLECTIVES=xla: JAX had already made its devices on rank(s) {ranks} "
            "before jaxddp could start JAX's distributed runtime, so the ranks cannot share "
            "one mesh. Import jaxddp before the program's first JAX computation (with "
            "mpi4py.rc.initialize = False: call jaxddp.rank() first), or unset "
            "JAXDDP_COLLECTIVES."
        )
        raise RuntimeError(msg)
    shared = comm.allgather(_gpus.assignment().sharing)
    together = sorted({group for group in shared if len(group) > 1})
    if together:
        groups = "; ".join("ranks " + ", ".join(map(str, g)) for g in together)
        msg = (
            "JAXDDP_COLLECTIVES=xla needs one GPU per rank: NCCL, which moves the bytes of "
            f"JAX's collectives on GPUs, refuses two ranks on one GPU, and here {groups} share "
            "one. Start one rank per GPU (`mpiexec -n <number of GPUs>`), or unset "
            "JAXDDP_COLLECTIVES (jaxddp's MPI path runs several ranks on a GPU)."
        )
        raise RuntimeError(msg)
    address = None
    if rank == 0:
        host = "127.0.0.1" if one_node else socket.gethostname()
        address = f"{host}:{_free_port()}"
    address = comm.bcast(address, root=0)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service (on by default) replaces the process's SIGTERM handler with
    # one that only records the signal: the job would train on through a scheduler's stop,
    # `timeout` or the program's own handler. A rank of jaxddp's world ends on SIGTERM as on
    # the MPI path, or does what the program's handler says.
    jax.config.update("jax_enable_preemption_service", False)
    timeout = _settings.startup_timeout()
    jax.distributed.initialize(
        address,
        num_processes=size,
        process_id=rank,
        initialization_timeout=int(min(timeout, 2**31 - 1)),
    )
    if jax.process_count() != size or jax.process_index() != rank:
        msg = (
            f"JAX's distributed runtime started as process {jax.process_index()} of "
            f"{jax.process_count()}, where jaxddp's MPI world has rank {rank} of {size}."
        )
        raise RuntimeError(msg)
    _started = True


def mesh() -> Any:
    """The ranks' one-axis mesh (axis ``jaxddp_ranks``): each rank's first device, in rank
    order. Built once."""
    global _mesh
    if _mesh is None:
        from jax.sharding import Mesh

        firsts: dict[int, Any] = {}
        for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
            firsts.setdefault(device.process_index, device)
        devices = [firsts[p] for p in sorted(firsts)]
        local = jax.local_devices()[0]
        if devices[jax.process_index()] != local:
            msg = (
                f"this rank's first device is {local}, but the mesh would use "
                f"{devices[jax.process_index()]}: give each rank one device (JAXDDP_GPUS=auto)."
            )
            raise RuntimeError(msg)
        _mesh = Mesh(np.array(devices), ("jaxddp_ranks",))
    return _mesh
