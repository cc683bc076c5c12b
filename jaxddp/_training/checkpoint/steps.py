"""What the writing rank does with Orbax: open the directory; for one step, write it
(checksums first), read it back verified against its target and its checksums, move it
aside when it was found damaged."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
from typing import Any

import numpy as np

from .sharded import description, remove_stale, slices_folder
from .trees import (
    METADATA_KEY,
    DamagedCheckpointError,
    check_matches,
    checksums,
    saved_numbers,
    verify,
)

__all__ = [
    "check_step",
    "move_aside",
    "open_orbax",
    "read_step",
    "remove_leftovers",
    "require_orbax",
    "write_step",
]

# Orbax's temporary folder of a step being written: `<step>.orbax-checkpoint-tmp`, with a
# suffix in some versions; renamed to `<step>` when the write is complete
_ORBAX_TEMPORARY = re.compile(r"\d+\.orbax-checkpoint-tmp.*")


def check_step(step: Any) -> int:
    """``step`` as an int, or ValueError."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        msg = f"Expected `step` to be a non-negative int, got {step!r} instead."
        raise ValueError(msg)
    return int(step)


def require_orbax() -> None:
    """ImportError naming the extra to install where Orbax cannot be imported. Checked on
    every rank before the manager's first collective, without importing Orbax (only the
    writer uses it); a rank without Orbax raises before the others wait for it, and its
    exception ends the job (the fail-fast abort)."""
    try:
        found = importlib.util.find_spec("orbax.checkpoint") is not None
    except ImportError:  # `orbax` itself missing, or blocked
        found = False
    if not found:
        msg = (
            "`jaxddp.CheckpointManager` needs Orbax (the `orbax-checkpoint` package), which is "
            'not installed: pip install "jaxddp[checkpoint]"'
        )
        raise ImportError(msg, name="orbax.checkpoint")


def open_orbax(directory: str, max_to_keep: int | None) -> Any:
    """Orbax's single-process manager of ``directory`` (created if missing)."""
    # Synchronous: a save returns complete anyway, and an asynchronous one that fails early
    # (the step's folder cannot be made) leaves Orbax's commit threads waiting for a signal
    # that never comes: non-daemon threads that keep the writer from exiting for Orbax's
    # 300 s timeout. The synchronous save costs the same.
    # Under JAX's distributed runtime (JAXDDP_COLLECTIVES=xla) Orbax would make every
    # process of it take part in the writer's barriers, and the writer would wait for ranks
    # that never open a manager: it is told that it writes alone (and then leaves making the
    # directory to its caller).
    import jax
    import orbax.checkpoint as ocp

    alone = {"primary_host": jax.process_index(), "active_processes": {jax.process_index()}}
    os.makedirs(directory, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=False,
        enable_async_checkpointing=False,
        multiprocessing_options=ocp.options.MultiprocessingOptions(**alone),
    )
    return ocp.CheckpointManager(
        directory,
        options=options,
        # known before the first save, so that a new process can read the metadata
        item_handlers=ocp.StandardCheckpointHandler(),
    )


def move_aside(manager: Any, directory: str, step: int) -> str | None:
    """Moves the folder of ``step`` (and its slices), found damaged, aside so that it can be
    saved anew; returns where to, or None when there was no folder. Orbax lists only
    folders named as a step, so it no longer sees it."""
    folder = os.path.join(directory, str(step))  # Orbax's name of the step
    if not os.path.isdir(folder):
        return None
    aside, n = f"{folder}.damaged", 1
    while os.path.lexists(aside):
        aside, n = f"{folder}.damaged-{n}", n + 1
    os.rename(folder, aside)
    if os.path.isdir(slices_folder(directory, step)):
        os.rename(slices_folder(directory, step), f"{aside}.slices")
    manager.reload()
    return aside


def write_step(manager: Any, step: int, host: Any, entry: dict[str, Any]) -> None:
    """The write of a save, on the writer's background thread: checksums, then Orbax (with
    ``entry`` in jaxddp's metadata: the description of a ShardedState's slices); then,
    whether it succeeded or failed, what no listed step uses is removed
    (:func:`remove_leftovers`)."""
    import orbax.checkpoint as ocp

    try:
        metadata = {METADATA_KEY: {"crc32": checksums(host), **entry}}
        manager.save(step, args=ocp.args.StandardSave(host), force=True, custom_metadata=metadata)
        manager.wait_until_finished()
    except Exception as e:
        # the state was checked before: what fails here is the writing (tensorstore
        # reports a full disk as a ValueError), a RuntimeError as documented
        msg = f"{type(e).__name__}: {e}"
        raise RuntimeError(msg) from e
    finally:
        remove_leftovers(manager)


def remove_leftovers(manager: Any) -> None:
    """Removes, on the writer once its write has ended, what no step Orbax lists will use:
    Orbax's temporary folders (a write that failed, or a process killed during one, leaves
    its ``<step>.orbax-checkpoint-tmp`` behind, one per failed step, and Orbax never removes
    it), and the slices of steps Orbax does not list (``max_to_keep``, a save that failed
    after its slices were written) with any ``.slices.tmp`` folder. No write is in flight
    then: a manager writes one save at a time, and Orbax's is synchronous here. Never
    raises: what cannot be removed now is tried again after the next save."""
    with contextlib.suppress(Exception):
        directory = os.fspath(manager.directory)
        for name in os.listdir(directory):
            if _ORBAX_TEMPORARY.fullmatch(name):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        remove_stale(directory, manager.all_steps())


def read_step(manager: Any, step: int, storable_target: Any, allow_missing: bool) -> Any:
    """``(restored, verified, slices)``: step ``step`` read into ``storable_target`` and
    checked, and the description of its ShardedStates' slices (or None); raises
    DamagedCheckpointError for what cannot be read or fails its checksums."""
    import orbax.checkpoint as ocp

    # Compared before reading: a read that fails halfway leaves tensorstore
    # callbacks for an event loop already closed ("Event loop is closed" on stderr).
    metadata = unreadable(step, "its metadata", lambda: manager.item_metadata(step))
    if getattr(metadata, "tree", None) is not None:
        check_matches(metadata, storable_target, step)
    restored = unreadable(
        step,
        "its arrays",
        lambda: manager.restore(step, args=ocp.args.StandardRestore(storable_target)),
    )
    check_matches(restored, storable_target, step)
    saved = unreadable(step, "its checksums", lambda: manager.metadata(step))
    verified = verify(
        restored,
        getattr(saved, "custom_metadata", None),
        step,
        numbers=saved_numbers(metadata),
        allow_missing=allow_missing,
    )
    return restored, verified, description(getattr(saved, "custom_metadata", None))


def unreadable(step: int, what: str, read: Any) -> Any:
    """``read()``, with a failure reported as a damaged checkpoint (a target of another
    structure is caught before, against the metadata: see ``restore``)."""
    try:
        return read()
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:300]  # tensorstore's spec follows: cut
        msg = f"Checkpoint {step} is damaged: {what} cannot be read ({type(e).__name__}: {first})."
        raise DamagedCheckpointError(msg) from e
