"""Checkpoints every rank agrees on: written once with Orbax, restored everywhere.

Orbax knows processes through ``jax.process_index()``, which is 0 on every MPI rank (jax
knows nothing of MPI): left alone, every rank believes it is the primary writer. Here the
first rank of the communicator does all file I/O with a single-process Orbax
``CheckpointManager``; the others wait for its outcome, an error included, so that every
rank raises the same error and none waits forever. A restored state is read by that rank
and broadcast, so the directory needs to be visible to it alone. Every saved array carries
a CRC-32 of its bytes in the step's metadata; a restore verifies them on the reading rank
before any rank uses the values, and a resume (``restore(None, ...)``) falls back to the
newest intact checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import warnings
import zlib
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np

from .._collectives import api as _comm
from .._collectives import consistency as _consistency
from .._collectives.dtypes import is_key_dtype
from .._runtime import world as _world

__all__ = ["CheckpointManager", "DamagedCheckpointError"]

_ROOT = 0
_METADATA_KEY = "jaxddp"  # in Orbax's custom metadata of a step: {"crc32": {path: crc}}


class DamagedCheckpointError(RuntimeError):
    """A checkpoint whose files cannot be read or whose values fail their checksums."""


def _is_key(leaf: Any) -> bool:
    return is_key_dtype(getattr(leaf, "dtype", None))


def _is_empty(leaf: Any) -> bool:
    return getattr(leaf, "size", None) == 0


def _storable_leaf(leaf: Any) -> Any:
    if _is_key(leaf):
        leaf = jax.random.key_data(leaf)
    if isinstance(leaf, np.generic | complex):  # Orbax stores arrays and Python numbers
        leaf = np.asarray(leaf)
    if _is_empty(leaf):  # Orbax refuses empty arrays; the target knows the shape
        return np.zeros((), np.asarray(leaf).dtype)
    return leaf


def _storable(tree: Any) -> Any:
    """``tree`` as Orbax can store it: typed PRNG keys as their key data, empty arrays as
    a scalar placeholder."""
    return jax.tree_util.tree_map(_storable_leaf, tree)


def _describe(leaf: Any) -> tuple[Any, ...]:
    """(shape, dtype) of an array or of Orbax's metadata of one; a Python number's kind."""
    if isinstance(leaf, bool | int | float | complex | str):
        return (type(leaf).__name__,)
    if _is_key(leaf):
        return (tuple(np.shape(leaf)), "key")
    dtype = getattr(leaf, "dtype", None)
    return (_shape(leaf), str(np.asarray(leaf).dtype if dtype is None else np.dtype(dtype)))


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)


class CheckpointManager:
    """Saves and restores a training state, the same on every rank, with Orbax.

    Used like Orbax's ``CheckpointManager``: ``save(step, state)``, ``latest_step()``,
    ``restore(step, target)``. Every method is collective over ``comm``: every rank calls
    it, in the same order. The first rank writes (Orbax's atomic finalize: a crash or a
    ``kill -9`` during a save leaves the previous checkpoints intact and loadable); the others
    wait and learn the outcome, so an error on the writer (an unwritable directory, a full
    disk) is raised on every rank. ``restore`` reads on the first rank and broadcasts, so
    every rank gets an identical state.

    ``state`` is any pytree of arrays and numbers: parameters, optimizer state,
    ``nnx.state(model)``, a linen ``TrainState``, the sampler's ``state_dict()``, the step
    counter, PRNG keys (typed keys are stored as their key data and come back as keys of the
    target's kind). The ranks' states should be identical (after
    :func:`jaxddp.allreduce_gradients` and :func:`jaxddp.average_state` they are): the first
    rank's is the one saved. Their structures are checked to match.

    Needs ``orbax-checkpoint`` (``pip install jaxddp[checkpoint]``).

    Args:
      directory: where checkpoints go, one subdirectory per step; created if missing.
      max_to_keep: how many of the newest checkpoints to keep; ``None`` keeps all.
      comm: an mpi4py communicator whose ranks share the state; by default the world. jaxddp
        talks on a private duplicate of it.

    Example:
      >>> import tempfile, jax.numpy as jnp, jaxddp
      >>> state = {"params": {"w": jnp.ones(3)}, "step": 10}
      >>> with tempfile.TemporaryDirectory() as d, jaxddp.CheckpointManager(d) as ckpt:
      ...     ckpt.save(10, state)
      ...     step = ckpt.latest_step()
      ...     restored = ckpt.restore(step, state)
      >>> step, restored["step"], restored["params"]["w"].tolist()
      (10, 10, [1.0, 1.0, 1.0])
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int | None = None,
                 comm: Any = None) -> None:  # fmt: skip
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            msg = f"Expected `max_to_keep` to be a positive int or None, got {max_to_keep!r}."
            raise ValueError(msg)
        self._user_comm = comm
        self._comm = _world.check_comm(comm)
        self._writer = self._comm.Get_rank() == _ROOT
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager: Any = None

        def open_manager() -> None:
            import orbax.checkpoint as ocp

            options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=options,
                # known before the first save, so that a new process can read the metadata
                item_handlers=ocp.StandardCheckpointHandler(),
            )

        self._on_writer(open_manager, f"open the checkpoint directory {self.directory!r}")

    # -- the one pattern: the writer acts, every rank learns the outcome --------------------

    def _on_writer(self, action: Any, doing: str) -> Any:
        """Runs ``action()`` on the writer; returns its result there (None elsewhere) and
        raises on every rank if it failed there: ValueError where the writer's error was one
        (a state that does not match, bad input), :class:`DamagedCheckpointError` for a
        checkpoint that cannot be read or fails its checksums, RuntimeError for anything
        else (the file system, Orbax)."""
        result, error = None, None
        if self._writer:
            try:
                result = action()
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = (_kind(e), f"{type(e).__name__}: {e}")
        error = self._comm.bcast(error, root=_ROOT)
        if error is not None:
            kind, text = error
            where = "" if self._writer else f" (on rank {_ROOT}, which writes)"
            msg = f"Could not {doing}{where}: {text}"
            raise _ERRORS[kind](msg)
        return result

    def _manager_or_raise(self) -> Any:
        if self._writer and self._manager is None:
            msg = "This CheckpointManager is closed."
            raise RuntimeError(msg)
        return self._manager

    # -- the API -------------------------------------------------------------------------

    def save(self, step: int, state: Any) -> None:
        """Writes ``state`` (the first rank's) as checkpoint ``step`` and waits until it is
        complete on disk. Collective: every rank calls it, and gets the writer's error."""
        import orbax.checkpoint as ocp

        step = _check_step(step)
        storable = _storable(state)
        _consistency.check_same_tree(storable, what="checkpointed state", comm=self._user_comm)

        def write() -> None:
            manager = self._manager_or_raise()
            metadata = {_METADATA_KEY: {"crc32": _checksums(storable)}}
            try:
                manager.save(
                    step, args=ocp.args.StandardSave(storable), force=True, custom_metadata=metadata
                )
                manager.wait_until_finished()
            except Exception as e:
                # the state was checked above: what fails here is the writing (tensorstore
                # reports a full disk as a ValueError), a RuntimeError as documented
                msg = f"{type(e).__name__}: {e}"
                raise RuntimeError(msg) from e

        self._on_writer(write, f"save checkpoint {step} in {self.directory!r}")

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first, the same on every rank."""
        steps = self._on_writer(
            lambda: sorted(self._manager_or_raise().all_steps()),
            f"list the checkpoints in {self.directory!r}",
        )
        return self._comm.bcast(steps, root=_ROOT)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None; the same on every rank."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None, target: Any) -> Any:
        """Checkpoint ``step`` (the newest intact one when None), on every rank, shaped as
        ``target``.

        ``target`` is a state of the same structure, shapes and dtypes as the one saved,
        e.g. the freshly initialized state; its values are not used. A checkpoint of another
        structure (another model, another optimizer) raises ValueError on every rank naming
        the first difference. The restored leaves are jax arrays where ``target`` has jax
        arrays, typed keys where it has keys, numbers where it has numbers.

        The reading rank checks every array against the checksum saved with it before any
        rank gets a value. A checkpoint that fails it, or whose files cannot be read, raises
        :class:`DamagedCheckpointError` (a RuntimeError) on every rank naming the step and
        the entry; with ``step=None`` the next older checkpoint is tried instead, with a
        RuntimeWarning on every rank, and the error comes only when none is intact.
        """
        import orbax.checkpoint as ocp

        if step is None:
            candidates = self.all_steps()[::-1]
            if not candidates:
                msg = f"There is no checkpoint in {self.directory!r} to restore."
                raise FileNotFoundError(msg)
        else:
            candidates = [_check_step(step)]
        storable_target = _storable(target)
        _consistency.check_same_tree(storable_target, what="restore target", comm=self._user_comm)

        def read(step: int) -> Any:
            manager = self._manager_or_raise()
            # Compared before reading: a read that fails halfway leaves tensorstore
            # callbacks for an event loop already closed ("Event loop is closed" on stderr).
            metadata = _unreadable(step, "its metadata", lambda: manager.item_metadata(step))
            if getattr(metadata, "tree", None) is not None:
                _check_matches(metadata, storable_target, step)
            restored = _unreadable(
                step,
                "its arrays",
                lambda: manager.restore(step, args=ocp.args.StandardRestore(storable_target)),
            )
            _check_matches(restored, storable_target, step)
            saved = _unreadable(step, "its checksums", lambda: manager.metadata(step))
            _verify(restored, getattr(saved, "custom_metadata", None), step)
            return restored

        for i, candidate in enumerate(candidates):
            try:
                restored = self._on_writer(
                    lambda s=candidate: read(s),
                    f"restore checkpoint {candidate} from {self.directory!r}",
                )
            except DamagedCheckpointError as e:
                if i + 1 == len(candidates):
                    raise
                warnings.warn(
                    f"{e} Falling back to checkpoint {candidates[i + 1]}.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            values = restored if self._writer else storable_target
            values = _comm.broadcast(values, root=_ROOT, comm=self._user_comm)
            return jax.tree_util.tree_map(_like, values, target)
        raise AssertionError  # unreachable: the last candidate returns or raises

    def close(self) -> None:
        """Waits for Orbax and releases it; collective."""
        if self._writer and self._manager is not None:
            manager, self._manager = self._manager, None
            self._on_writer(manager.close, "close the checkpoint manager")
        else:
            self._on_writer(lambda: None, "close the checkpoint manager")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        # An exception is propagating on this rank: no collective now (the other ranks may
        # be elsewhere, and the exception must reach the fail-fast abort). Release Orbax
        # here alone.
        if self._manager is not None:
            manager, self._manager = self._manager, None
            with contextlib.suppress(Exception):
                manager.close()

    def __repr__(self) -> str:
        return f"jaxddp.CheckpointManager({self.directory!r})"


def _kind(error: Exception) -> str:
    if isinstance(error, DamagedCheckpointError):
        return "damaged"
    return "invalid" if isinstance(error, ValueError) else "other"


_ERRORS: dict[str, type[Exception]] = {
    "damaged": DamagedCheckpointError,
    "invalid": ValueError,
    "other": RuntimeError,
}


def _crc32(leaf: Any) -> int | None:
    """The CRC-32 of an array leaf's bytes (C order); None for Python numbers."""
    if isinstance(leaf, bool | int | float | complex | str):
        return None
    array = np.ascontiguousarray(np.asarray(leaf))
    data: Any = array.reshape(-1).view(np.uint8)  # a buffer: zlib reads it without a copy
    return zlib.crc32(data if array.size else b"")


def _checksums(storable: Any) -> dict[str, int]:
    """``{path: crc32}`` for every array leaf of a storable state. zlib releases the GIL
    while it hashes, so the leaves are hashed on a few threads at once."""
    leaves = _by_path(storable)
    workers = min(4, os.cpu_count() or 1, max(1, len(leaves)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        crcs = list(pool.map(_crc32, leaves.values()))
    return {"/".join(path): crc for path, crc in zip(leaves, crcs, strict=True) if crc is not None}


def _verify(restored: Any, custom: Any, step: int) -> None:
    """Raises DamagedCheckpointError naming the first array whose bytes fail the checksum
    saved with it. A checkpoint saved without checksums (by an older jaxddp) passes."""
    saved = custom.get(_METADATA_KEY, {}).get("crc32") if isinstance(custom, dict) else None
    if not saved:
        return
    for path, leaf in _by_path(restored).items():
        name = "/".join(path)
        crc = _crc32(leaf)
        if crc is not None and name in saved and int(saved[name]) != crc:
            msg = (
                f"Checkpoint {step} is damaged: the values read for `{_path_text(path)}` fail "
                f"the checksum saved with them (CRC-32 {crc:08x}, saved {int(saved[name]):08x}); "
                "its files were changed or corrupted after the save."
            )
            raise DamagedCheckpointError(msg)


def _unreadable(step: int, what: str, read: Any) -> Any:
    """``read()``, with a failure reported as a damaged checkpoint (a target of another
    structure is caught before, against the metadata: see ``restore``)."""
    try:
        return read()
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:300]  # tensorstore's spec follows: cut
        msg = f"Checkpoint {step} is damaged: {what} cannot be read ({type(e).__name__}: {first})."
        raise DamagedCheckpointError(msg) from e


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        msg = f"Expected `step` to be a non-negative int, got {step!r} instead."
        raise ValueError(msg)
    return int(step)


def _key_name(key: Any) -> str:
    for field in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey, ...
        if hasattr(key, field):
            return str(getattr(key, field))
    return str(key)


def _by_path(tree: Any) -> dict[tuple[str, ...], Any]:
    """Leaves by their path as names: a dict, a dataclass and Orbax's metadata of either
    name their entries alike."""
    tree = getattr(tree, "tree", tree)  # Orbax's TreeMetadata holds the tree
    return {
        tuple(map(_key_name, path)): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _path_text(path: tuple[str, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path)


def _check_matches(saved: Any, target: Any, step: int) -> None:
    """Raises ValueError naming the first entry that the saved tree (restored leaves, or
    Orbax's metadata of them) and the target do not share, or whose shape or dtype differs
    (Orbax compares the structures, not always the shapes)."""
    got, want = _by_path(saved), _by_path(target)
    for path in sorted(got.keys() ^ want.keys()):
        has, lacks = ("checkpoint", "target") if path in got else ("target", "checkpoint")
        msg = (
            f"Checkpoint {step} does not match the target: the {has} has an entry "
            f"`{_path_text(path)}` that the {lacks} lacks. It is a checkpoint of another "
            "state (another model, another optimizer)."
        )
        raise ValueError(msg)
    for path, b in want.items():
        a = got[path]
        if _describe(a)[:2] != _describe(b)[:2] and not (
            isinstance(b, bool | int | float) and _shape(a) == ()
        ):
            msg = (
                f"Checkpoint {step} holds {_describe(a)} at "
                f"`{_path_text(path)}`, but the target has {_describe(b)} "
                "there: it is a checkpoint of another state."
            )
            raise ValueError(msg)


def _like(value: Any, target: Any) -> Any:
    """A restored leaf in the kind of the target's: keys, jax arrays, NumPy, numbers."""
    if _is_empty(target):
        return target
    if _is_key(target):
        return jax.random.wrap_key_data(jnp.asarray(value), impl=jax.random.key_impl(target))
    if isinstance(target, np.generic):  # a NumPy number stays one
        return type(target)(np.asarray(value).item())
    if isinstance(target, np.ndarray):
        return np.asarray(value, dtype=target.dtype)
    return _comm.restore_kind(target, value)  # numbers, jax arrays
