"""Checkpoints every rank agrees on: written once with Orbax by the first rank, in the
background, restored everywhere (:class:`CheckpointManager` says how). Orbax knows processes
through ``jax.process_index()``, 0 on every MPI rank, so the first rank does all file I/O and
the others learn its outcome: every rank raises the same error and none waits forever. The
save's thread and its outcomes: :mod:`.saving`; the ranks' comparison: :mod:`.replicated`;
a ``ShardedState``'s slices: :mod:`.sharded`."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Self

import jax

from ..._collectives import api as _comm
from ..._collectives import consistency as _consistency
from ..._runtime import world as _world
from ..._types import Communicator
from . import background as _background
from . import saving as _saving
from . import sharded
from .steps import (
    check_step,
    move_aside,
    open_orbax,
    read_step,
    require_orbax,
)
from .trees import DamagedCheckpointError, restored_like, to_storable

__all__ = ["CheckpointManager", "DamagedCheckpointError"]

_ROOT = 0


class CheckpointManager:
    """Saves and restores a training state, the same on every rank, with Orbax.

    Used like Orbax's ``CheckpointManager``: ``save(step, state)``, ``latest_step()``,
    ``restore(step, target)``. Every method is collective over ``comm``: every rank calls
    it, in the same order (a method called on some ranks only, as under ``if rank == 0:``,
    raises TimeoutError there naming the ranks that did not call it, within
    ``JAXDDP_CHECK_TIMEOUT`` seconds or half of ``JAXDDP_STALL_ABORT``). The first rank writes (Orbax's atomic finalize: a crash or a
    ``kill -9`` during a save leaves the previous checkpoints intact and loadable).

    ``save`` returns once every rank holds its own copy of the state in host memory (kept
    for the next save to copy into, until ``close``); the ranks' comparison and the write
    go on in the background while the loop trains. At most one save is in
    flight: the manager's next call (``save``, ``restore``, ``all_steps``,
    ``latest_step``, :meth:`wait_until_finished`, ``close``) waits for it first, on every
    rank, and raises its error there, on every rank, as the type a blocking save raises
    (RuntimeError with the writer's message for the file system or Orbax). A save still in
    flight at exit is waited for; if it failed, every rank prints why and the job ends with
    status 1. ``background=False`` makes ``save`` return only when the checkpoint is
    complete on disk. ``restore`` reads on the first rank and broadcasts, so every rank
    gets an identical state.

    ``state`` is any pytree of arrays and numbers: parameters, optimizer state,
    ``nnx.state(model)``, a linen ``TrainState``, the sampler's ``state_dict()``, the step
    counter, PRNG keys (typed keys are stored as their key data and come back as keys of the
    target's kind). The ranks' states must be identical (after
    :func:`jaxddp.allreduce_gradients` and :func:`jaxddp.average_state` they are): the first
    rank's is the one saved, so a save where any rank holds other values (compared by
    fingerprint; a ``ShardedState``'s slices, each rank's own, excepted) is refused on every
    rank with a ValueError naming the entry (from the manager's next call, after a background
    save), and nothing of it is written.

    Needs ``orbax-checkpoint``: without it, ImportError (``pip install orbax-checkpoint``).

    Args:
      directory: where checkpoints go, one subdirectory per step; created if missing.
      max_to_keep: how many of the newest checkpoints to keep; ``None`` keeps all.
      comm: an mpi4py communicator whose ranks share the state; by default the world. jaxddp
        talks on a private duplicate of it.
      background: write in a background thread (the default), or in ``save`` itself.

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
                 comm: Communicator | None = None, background: bool = True) -> None:  # fmt: skip
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            msg = f"Expected `max_to_keep` to be a positive int or None, got {max_to_keep!r}."
            raise ValueError(msg)
        if not isinstance(background, bool):
            msg = f"Expected `background` to be True or False, got {background!r}."
            raise TypeError(msg)
        require_orbax()  # on every rank, before any rank waits for the others
        self._background = background
        self._write: _background.Write | None = None  # the writer's save in flight
        self._spare: Any = None  # the last save's host copy: the next one copies into it
        self._in_flight: int | None = None  # its step, on every rank
        self._user_comm, self._comm = comm, _world.check_comm(comm)
        self._writer = self._comm.Get_rank() == _ROOT
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager: Any = None
        self._damaged: set[int] = set()  # steps that restore found damaged, on every rank
        self._meet("CheckpointManager(...)")
        # background saves compare on their own thread, on a communicator of their own:
        # MPI_THREAD_MULTIPLE (jaxddp's); without it, ``save`` compares them itself
        self._compare_comm: Any = None
        if background and self._comm.Get_size() > 1 and _saving.threads_may_talk():
            self._compare_comm = self._comm.Dup()
        self._manager = self._on_writer(
            lambda: open_orbax(self.directory, max_to_keep),
            f"open the checkpoint directory {self.directory!r}",
        )

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
                error = (_saving.kind_of(e), f"{type(e).__name__}: {e}")
        self._raise_on_every_rank(error, doing)
        return result

    def _raise_on_every_rank(self, error: tuple[str, str] | None, doing: str) -> None:
        """Raises the writer's ``error`` (``(kind, text)``, or None for none) on every rank."""
        error = self._comm.bcast(error, root=_ROOT)
        if error is not None:
            kind, text = error
            if kind in _saving.REFUSED:  # the ranks' comparison: the same whole message everywhere
                raise _saving.REFUSED[kind](text)
            where = "" if self._writer else f" (on rank {_ROOT}, which writes)"
            msg = f"Could not {doing}{where}: {text}"
            raise _saving.ERRORS[kind](msg)

    def _meet(self, call: str) -> None:
        """Returns once every rank has called ``call`` (:func:`.consistency.roll_call`)."""
        _consistency.roll_call(self._comm, call, why=_saving.COLLECTIVE)

    def _manager_or_raise(self) -> Any:
        if self._writer and self._manager is None:
            msg = "This CheckpointManager is closed."
            raise RuntimeError(msg)
        return self._manager

    def _settle(self) -> None:
        """Waits for the save in flight, if any, and raises its error on every rank."""
        step = self._in_flight
        if step is None:
            return
        error = self._write.wait() if self._write is not None else None
        self._write, self._in_flight = None, None
        _background.settled(self)
        self._raise_on_every_rank(error, f"save checkpoint {step} in {self.directory!r}")

    def _wait_alone(self) -> None:
        """Waits for this rank's own write, talking to no other rank (an exception is on its
        way out of this rank)."""
        if self._write is not None:
            self._write.wait()
        self._write, self._in_flight = None, None
        _background.settled(self)

    # -- the API -------------------------------------------------------------------------

    def save(self, step: int, state: Any) -> None:
        """Saves ``state`` (the first rank's) as checkpoint ``step``. Collective: every rank
        calls it.

        Returns once every rank holds a copy of its state in host memory (the loop may then
        change or donate its arrays: what is compared and written is what was passed); the
        ranks' copies are compared (a fingerprint of every leaf, one allgather) and the
        writer's is written in the background. The previous save is waited for first, and
        its error, if it failed or its ranks' states differed, is raised here on every rank
        (this save is then not made). With ``background=False`` (or an MPI without
        ``MPI_THREAD_MULTIPLE``, where only the main thread may talk) the states are
        compared here, before ``save`` returns; with ``background=False``, it returns when
        the checkpoint is complete on disk, or raises its error on every rank.

        A step is saved once, except one that :meth:`restore` found damaged: its folder is
        moved aside to ``<step>.damaged`` (a RuntimeWarning) and the step saved anew."""
        self._meet("CheckpointManager.save")
        step = check_step(step)
        storable = to_storable(state)
        _consistency.check_same_tree(storable, what="checkpointed state", comm=self._user_comm)
        self._settle()
        if step in self._damaged:
            self._replace_damaged(step)
        doing = f"save checkpoint {step} in {self.directory!r}"
        tree, pieces = sharded.split_state(self._comm, storable, step)  # the slices: apart
        compare_comm = self._compare_comm
        host, held, self._spare = _saving.host_copy(
            self._comm, compare_comm, tree, writer=self._writer, background=self._background,
            spare=self._spare, step=step, doing=doing,
        )  # fmt: skip
        # a ShardedState's slices: written by every rank, complete before Orbax lists the step
        entry = sharded.save_slices(
            self._comm, self.directory, step, pieces, self._manager_or_raise
        )

        def check_new() -> Any:
            manager = self._manager_or_raise()
            if step in manager.all_steps():
                msg = (
                    f"checkpoint {step} exists already: a step is saved once (restore skips "
                    "a damaged one, and its next save replaces it)."
                )
                raise RuntimeError(msg)
            return manager

        manager = self._on_writer(check_new, doing)
        write = _saving.writing(
            compare_comm, host, held, step=step, doing=doing, directory=self.directory,
            write=(manager, entry) if self._writer else None,
        )  # fmt: skip
        del held
        if write is not None:
            self._write = write
        self._in_flight = step
        _background.in_flight(self)
        if not self._background:
            self._settle()

    def wait_until_finished(self) -> None:
        """Waits until the save in flight is complete on disk, on every rank; raises its
        error, if it failed, on every rank. Collective."""
        self._meet("CheckpointManager.wait_until_finished")
        self._settle()

    def _replace_damaged(self, step: int) -> None:
        """Moves the folder of ``step``, found damaged, aside so that it can be saved anew."""

        aside = self._on_writer(
            lambda: move_aside(self._manager_or_raise(), self.directory, step),
            f"move the damaged checkpoint {step} aside",
        )
        aside = self._comm.bcast(aside, root=_ROOT)
        self._damaged.discard(step)
        if aside is not None:
            warnings.warn(
                f"Checkpoint {step} in {self.directory!r}, which restore found damaged, is "
                f"moved aside to {aside!r} to save step {step} anew.",
                RuntimeWarning,
                stacklevel=3,
            )

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first, the same on every rank (after
        the save in flight is complete)."""
        self._meet("CheckpointManager.all_steps")
        return self._all_steps()

    def _all_steps(self) -> list[int]:
        self._settle()
        steps = self._on_writer(
            lambda: sorted(self._manager_or_raise().all_steps()),
            f"list the checkpoints in {self.directory!r}",
        )
        return self._comm.bcast(steps, root=_ROOT)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None; the same on every rank."""
        self._meet("CheckpointManager.latest_step")
        steps = self._all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None, target: Any, *,
                allow_missing_checksums: bool = False) -> Any:  # fmt: skip
        """Checkpoint ``step`` (the newest intact one when None), on every rank, shaped as
        ``target``.

        ``target`` is a state of the same structure, shapes and dtypes as the one saved,
        e.g. the freshly initialized state; its values are not used. A checkpoint of another
        structure (another model, another optimizer), or with another dtype anywhere (a
        float where an int was saved, or the other way), raises ValueError on every rank
        naming the first difference: nothing is converted. The restored leaves are jax
        arrays where ``target`` has jax arrays, typed keys where it has keys, numbers where
        it has numbers.

        The reading rank checks every array against the checksum saved with it before any
        rank gets a value. A checkpoint that fails it, whose files cannot be read, or whose
        metadata holds no checksums (unreadable, cut short, or without jaxddp's entry)
        raises :class:`DamagedCheckpointError` (a RuntimeError) on every rank naming the
        step and the entry; with ``step=None`` the next older checkpoint is tried instead,
        with a RuntimeWarning on every rank, and the error comes only when none is intact.
        A later ``save`` of a step found damaged moves it aside (see :meth:`save`).

        Args:
          step: the checkpoint to restore; None for the newest intact one.
          target: a state shaped as the one saved.
          allow_missing_checksums: restore a checkpoint whose metadata holds no checksums
            (one written before jaxddp saved them) unverified, with a RuntimeWarning on
            every rank, instead of calling it damaged. Checksums that are there are
            verified all the same.
        """
        self._meet("CheckpointManager.restore")
        self._settle()
        if step is None:
            candidates = self._all_steps()[::-1]
            if not candidates:
                msg = f"There is no checkpoint in {self.directory!r} to restore."
                raise FileNotFoundError(msg)
        else:
            candidates = [check_step(step)]
        storable_target = to_storable(target)
        _consistency.check_same_tree(storable_target, what="restore target", comm=self._user_comm)
        storable_target, wanted = sharded.split_target(self._comm, storable_target)  # slices: below

        for i, candidate in enumerate(candidates):
            try:
                restored, verified, described = self._on_writer(
                    lambda s=candidate: read_step(
                        self._manager_or_raise(), s, storable_target, allow_missing_checksums
                    ),
                    f"restore checkpoint {candidate} from {self.directory!r}",
                ) or (None, None, None)
                arrays = sharded.restore_slices(  # every rank its own, at this world size
                    self._comm, self.directory, candidate, described, wanted
                )
            except DamagedCheckpointError as e:
                self._damaged.add(candidate)  # a save of this step replaces it
                if i + 1 == len(candidates):
                    raise
                warnings.warn(
                    f"{e} Falling back to checkpoint {candidates[i + 1]}.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            self._damaged.discard(candidate)
            if not self._comm.bcast(verified, root=_ROOT):
                warnings.warn(
                    f"Checkpoint {candidate} in {self.directory!r} holds no checksums (written "
                    "before jaxddp saved them, or its metadata is damaged): restored "
                    "unverified, as `allow_missing_checksums=True` asks.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            values = restored if self._writer else storable_target
            values = _comm.broadcast(values, root=_ROOT, comm=self._user_comm)
            values = sharded.merge(values, wanted, arrays)
            return jax.tree_util.tree_map(restored_like, values, target)
        raise AssertionError  # unreachable: the last candidate returns or raises

    def close(self) -> None:
        """Waits for the save in flight and releases Orbax; collective. Raises the save's
        error, if it failed, on every rank (Orbax is released all the same)."""
        try:
            self._meet("CheckpointManager.close")
        except Exception:
            self._release_alone()  # not every rank is here: nothing collective
            raise
        try:
            self._settle()
        finally:
            try:
                if self._writer and self._manager is not None:
                    manager, self._manager = self._manager, None
                    self._on_writer(manager.close, "close the checkpoint manager")
                else:
                    self._on_writer(lambda: None, "close the checkpoint manager")
            finally:
                self._spare = None
                if self._compare_comm is not None:  # no save in flight uses it now
                    compare_comm, self._compare_comm = self._compare_comm, None
                    compare_comm.Free()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # an exception propagating on this rank: no collective now (the other ranks may be
        # elsewhere, and the exception must reach the fail-fast abort)
        self.close() if exc_type is None else self._release_alone()

    def _release_alone(self) -> None:
        """Finishes this rank's write and releases Orbax here alone."""
        self._wait_alone()
        self._spare = None
        if self._manager is not None:
            manager, self._manager = self._manager, None
            with contextlib.suppress(Exception):
                manager.close()

    def __repr__(self) -> str:
        return f"jaxddp.CheckpointManager({self.directory!r})"
