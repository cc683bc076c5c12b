"""The sharded optimizer's slices of a checkpoint, written and read by every rank: the steps
of :class:`~jaxddp.CheckpointManager` where every rank touches files, each step's outcome
agreed on every rank (an allgather of the errors), so that every rank raises the same error
and none waits forever. The file format is :mod:`.slices`'.

A save: the first rank makes ``<directory>/<step>.slices.tmp``; every rank writes its file
there; the first rank checks that it sees every rank's file whole (a directory that is not
shared is an error here, on every rank), describes them and renames the folder to
``<directory>/<step>.slices``. Only then does Orbax save the step (the description in its
metadata): a step Orbax lists always has its slices complete. A restore: every rank reads,
from the old ranks' files, its slice at the new world size, and verifies what it reads.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..._types import Communicator
from . import slices
from .slices import merge
from .trees import METADATA_KEY, DamagedCheckpointError

__all__ = [
    "description",
    "merge",
    "remove_stale",
    "restore_slices",
    "save_slices",
    "slices_folder",
    "split_state",
    "split_target",
]

ROOT = 0  # the rank that writes with Orbax, makes and commits the folders
_STALE = re.compile(r"(\d+)\.slices(\.tmp)?")


def slices_folder(directory: str, step: int) -> str:
    return os.path.join(directory, f"{step}.slices")


def description(custom: Any) -> Any:
    """The slices' description in a step's custom metadata (Orbax's), or None."""
    entry = custom.get(METADATA_KEY) if isinstance(custom, dict) else None
    return entry.get("slices") if isinstance(entry, dict) else None


def _kind(error: Exception) -> type[Exception]:
    for kind in (DamagedCheckpointError, ValueError):
        if isinstance(error, kind):
            return kind
    return RuntimeError


def agree(comm: Communicator, action: Callable[[], Any], doing: str, *,
          share: bool = False) -> Any:  # fmt: skip
    """Runs ``action()`` on every rank and raises on every rank the first rank's error (in
    rank order) if any failed: DamagedCheckpointError, ValueError, or RuntimeError for
    anything else. Returns this rank's result, or with ``share`` every rank's."""
    result, error = None, None
    try:
        result = action()
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = (_kind(e), f"{type(e).__name__}: {e}")
    outcomes = comm.allgather((error, result if share else None))
    for rank, (failed, _) in enumerate(outcomes):
        if failed is not None:
            kind, text = failed
            msg = f"Could not {doing} (on rank {rank}): {text}"
            raise kind(msg)
    return [r for _, r in outcomes] if share else result


def _not_shared(who: int, what: str) -> RuntimeError:
    return RuntimeError(
        f"rank {who} does not see {what}. A sharded optimizer's state (jaxddp.ShardedState) "
        "is saved by every rank, each its own slices, into the checkpoint directory: it must "
        "be a directory every rank can write and read (a shared file system). Elsewhere, save "
        "the full state instead, gathered on every rank with `tx.gather_state(state, params)`."
    )


def split_target(comm: Communicator, storable: Any) -> tuple[Any, list[slices.Piece]]:
    """:func:`.slices.split` of a restore target, its errors agreed; collective."""
    return agree(comm, lambda: slices.split(storable), "restore into this target")


def split_state(comm: Communicator, storable: Any, step: int) -> tuple[Any, list[slices.Piece]]:
    """:func:`.slices.split` of a state to save, its errors agreed: the state as Orbax
    saves it, and this rank's slices; collective."""
    return agree(comm, lambda: slices.split(storable), f"save checkpoint {step}")


def save_slices(comm: Communicator, directory: str, step: int, pieces: list[slices.Piece],
                manager: Callable[[], Any]) -> dict[str, Any]:  # fmt: skip
    """For the step's metadata entry, ``{"slices": description}`` (on the first rank; ``{}``
    for a state without a ShardedState) once every rank's slices (``pieces``, from
    :func:`split_state`) are written into ``<step>.slices``; collective. ``manager()`` (on
    the first rank) gives Orbax's manager: a step it lists is not saved again."""
    if not pieces:
        return {}
    return {"slices": _write(comm, directory, step, pieces, manager)}


def _write(comm: Communicator, directory: str, step: int, pieces: list[slices.Piece],
           manager: Callable[[], Any]) -> dict[str, Any] | None:  # fmt: skip
    rank, size = comm.Get_rank(), comm.Get_size()
    first = rank == ROOT
    final = slices_folder(directory, step)
    tmp = f"{final}.tmp"
    doing = f"save the sharded optimizer's slices of checkpoint {step} in {directory!r}"

    def prepare() -> None:
        if not first:
            return
        if step in set(manager().all_steps()):
            msg = (
                f"checkpoint {step} exists already: a step is saved once (restore skips a "
                "damaged one, and its next save replaces it)."
            )
            raise RuntimeError(msg)
        for stale in (tmp, final):  # a save cut short, or that failed
            if os.path.lexists(stale):
                shutil.rmtree(stale)
        os.makedirs(tmp)

    def write() -> dict[str, Any]:
        if not os.path.isdir(tmp):
            raise _not_shared(rank, f"the folder {tmp!r} that rank {ROOT} made")
        return slices.write(tmp, rank, size, pieces)

    def commit(indices: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not first:
            return None
        for index in indices:  # every rank's file whole, as the first rank sees it
            path = os.path.join(tmp, index["file"])
            if not os.path.isfile(path) or os.path.getsize(path) != index["bytes"]:
                raise _not_shared(ROOT, f"the file {path!r} whole, that another rank wrote")
        described = slices.describe(indices, pieces)
        os.rename(tmp, final)
        _sync(directory)
        return described

    agree(comm, prepare, doing)
    try:
        indices = agree(comm, write, doing, share=True)
        return agree(comm, lambda: commit(indices), doing)
    except Exception:
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sync(directory: str) -> None:
    """Makes a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale(directory: str, steps: Iterable[int]) -> None:
    """Removes the slices of the steps Orbax no longer lists (``max_to_keep``, a save that
    failed after the rename) and any ``.tmp`` folder; on the first rank, after a save."""
    keep = set(steps)
    for name in os.listdir(directory):
        match = _STALE.fullmatch(name)
        if match and (match.group(2) or int(match.group(1)) not in keep):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def restore_slices(comm: Communicator, directory: str, step: int, meta: Any,
                   wanted: list[slices.Piece]) -> list[np.ndarray]:  # fmt: skip
    """This rank's slices of checkpoint ``step`` at the communicator's world size, read
    and verified by every rank; collective (nothing to do without ``wanted``, on every rank
    alike). ``meta`` is the description saved in the step's metadata, on the first rank."""
    if not wanted:
        return []
    meta = comm.bcast(meta, root=ROOT)
    rank, size = comm.Get_rank(), comm.Get_size()
    folder = slices_folder(directory, step)
    doing = f"restore the sharded optimizer's slices of checkpoint {step} from {directory!r}"
    seen = agree(comm, lambda: os.path.isdir(folder), doing, share=True)
    if not seen[ROOT]:
        msg = (
            f"Could not {doing}: Checkpoint {step} is damaged: the folder of its sharded "
            f"optimizer's slices, {folder!r}, is missing."
        )
        raise DamagedCheckpointError(msg)
    if not all(seen):
        msg = f"Could not {doing}: {_not_shared(seen.index(False), f'the folder {folder!r}')}"
        raise RuntimeError(msg)

    def read() -> list[np.ndarray]:
        return slices.read(folder, meta, wanted, rank=rank, size=size, step=step)

    return agree(comm, read, doing)
