"""The sampler's collective checks: every rank built its sampler from the same arguments,
starts the same pass, loaded the same state. The only place the sampler talks to MPI; a
sampler given ``num_replicas`` and ``rank`` without ``comm`` never comes here."""

from __future__ import annotations

from typing import Any

from .._collectives.consistency import gather_with_deadline
from .._runtime import world as _world
from .._types import Communicator
from . import shards as _shards

__all__ = [
    "agreed_arguments",
    "check_sampler_arguments",
    "check_sampler_pass",
    "check_sampler_states",
]


def agreed_arguments(
    data: Any,
    num_replicas: int | None,
    rank: int | None,
    *,
    comm: Communicator | None,
    **options: Any,
) -> tuple[int, int, int, bool, int, bool]:
    """A collective sampler's ``(N, num_replicas, rank, shuffle, seed, drop_last)``, the
    number of ranks and the rank taken from ``comm`` (the world by default) where not
    given, after checking that every rank passed the same.

    Every rank validates first, and then every rank takes part in the check even if its own
    arguments were bad: an error raised on some ranks only would leave the others waiting
    in that collective forever.
    """
    _world.init()
    group = _world.py_comm() if comm is None else comm
    num_replicas = group.Get_size() if num_replicas is None else num_replicas
    rank = group.Get_rank() if rank is None else rank
    problem: Exception | None = None
    mine = arguments = None
    try:
        arguments = _shards.arguments(data, num_replicas=num_replicas, rank=rank, **options)
        n, num_replicas, rank, shuffle, seed, drop_last = arguments
        mine = (n, num_replicas, seed, shuffle, drop_last, rank)
    except (TypeError, ValueError) as exc:
        problem = exc
    check_sampler_arguments(mine, problem, comm)
    if problem is not None:
        raise problem
    assert arguments is not None
    return arguments


def _gather_or_errors(
    private: Any, mine: Any, problem: Exception | None, *, what: str, expected: str
) -> list[Any] | None:
    """Every rank's ``mine``, or this rank's error text where it raised ``problem``.

    Returns None on a rank that raised (it raises its own error next) and raises ValueError
    on the others when any rank raised, naming each rank's error.
    """
    sent: Any = mine if problem is None else f"{type(problem).__name__}: {problem}"
    everyone = gather_with_deadline(private, sent, what=what, error=TimeoutError)
    failed = {r: v for r, v in enumerate(everyone) if isinstance(v, str)}
    if not failed:
        return everyone
    if problem is not None:
        return None
    details = "; ".join(f"rank {r}: {text}" for r, text in failed.items())
    msg = (
        f"Expected every rank to {expected}, got errors on {len(failed)} of "
        f"{len(everyone)} ranks instead ({details})."
    )
    raise ValueError(msg)


def _differences(everyone: list[Any], names: tuple[str, ...]) -> list[str]:
    """``name (rank 0: value, ...)`` for each field of the ranks' tuples that differs."""
    differing = []
    for i, name in enumerate(names):
        values = [v[i] for v in everyone]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            differing.append(f"{name} ({per_rank})")
    return differing


def check_sampler_arguments(
    mine: tuple[int, int, int, bool, bool, int] | None,
    problem: Exception | None,
    comm: Communicator | None,
) -> None:
    """Checks once, collectively, that every rank built its sampler from the same arguments.

    ``mine`` is this rank's ``(N, num_replicas, seed, shuffle, drop_last, rank)``, ``None``
    when its arguments raised ``problem``. Every rank of ``comm`` (the world when ``None``)
    must call this. Raises ValueError on every rank when a rank's arguments were invalid or
    differ from the others', and TimeoutError when some rank does not arrive within
    ``JAXDDP_CHECK_TIMEOUT`` seconds.
    """
    private = _world.check_comm(comm)
    size = private.Get_size()
    if size == 1:
        return
    everyone = _gather_or_errors(
        private,
        mine,
        problem,
        what="arguments of `DistributedSampler`",
        expected="build `DistributedSampler` from valid arguments",
    )
    if everyone is None:
        return  # this rank raises its own error
    names = ("`data` size", "`num_replicas`", "`seed`", "`shuffle`", "`drop_last`")
    differing = _differences(everyone, names)
    if differing:
        msg = (
            "Expected every rank to pass the same `data` size, `num_replicas`, `seed`, "
            "`shuffle` and `drop_last` to `DistributedSampler`, got different values instead: "
            f"{'; '.join(differing)}. Pass the same values on every rank; otherwise samples "
            "are silently duplicated and skipped."
        )
        raise ValueError(msg)
    ranks = [v[5] for v in everyone]
    unread = sorted(set(range(everyone[0][1])) - set(ranks))
    if unread:
        per_rank = ", ".join(f"MPI rank {r}: {v}" for r, v in enumerate(ranks))
        msg = (
            f"Expected the ranks to take every shard of `num_replicas={everyone[0][1]}`, got "
            f"`rank` values that leave shards {unread} to no rank instead ({per_rank}): those "
            "samples would silently never be seen. Leave `num_replicas` and `rank` to their "
            "defaults, or pass both explicitly."
        )
        raise ValueError(msg)


def check_sampler_states(
    mine: tuple[int, int] | None, problem: Exception | None, comm: Communicator | None
) -> None:
    """Checks, collectively, that every rank loaded the same state into its sampler.

    ``mine`` is this rank's loaded ``(epoch, position)``, ``None`` when its state raised
    ``problem``. Every rank of ``comm`` (the world when ``None``) must call this. Raises
    ValueError on every rank when a rank's state was invalid or differs from the others',
    and TimeoutError when some rank does not arrive within ``JAXDDP_CHECK_TIMEOUT`` seconds.
    """
    private = _world.check_comm(comm)
    if private.Get_size() == 1:
        return
    everyone = _gather_or_errors(
        private,
        mine,
        problem,
        what="states loaded by `DistributedSampler.load_state_dict`",
        expected="load a valid state into `DistributedSampler`",
    )
    if everyone is None:
        return  # this rank raises its own error
    differing = _differences(everyone, ("`epoch`", "`position`"))
    if differing:
        msg = (
            "Expected every rank to load the same state into `DistributedSampler`, got "
            f"different ones instead: {'; '.join(differing)}. Load one saved state on every "
            "rank (the state is the same on all ranks of the run that saved it: save rank "
            "0's); ranks at different positions would take different numbers of steps and "
            "wait for each other forever."
        )
        raise ValueError(msg)


def check_sampler_pass(mine: tuple[int, int | None, bool], comm: Communicator | None) -> None:
    """Checks, collectively, that every rank starts the same pass over the sampler.

    ``mine`` is this rank's ``(epoch, batch_size, drop_last)``, ``batch_size`` ``None`` for a
    pass of single indices (iterating over the sampler itself). Called at the start of every
    pass, so once per epoch: one small allgather. Raises ValueError on every rank when the
    ranks differ (ranks in different epochs train on different orders; ranks with different
    batch sizes take different numbers of steps and wait for each other forever), and
    TimeoutError when some rank does not start its pass within ``JAXDDP_CHECK_TIMEOUT``
    seconds.
    """
    private = _world.check_comm(comm)
    if private.Get_size() == 1:
        return
    everyone = gather_with_deadline(
        private, mine, what="pass over `DistributedSampler`", error=TimeoutError
    )
    differing = _differences(
        [(e, "iteration" if b is None else b, d) for e, b, d in everyone],
        ("`epoch`", "`batch_size`", "`drop_last` of `batches`"),
    )
    if differing:
        msg = (
            "Expected every rank to start the same pass over `DistributedSampler`, got "
            f"different ones instead: {'; '.join(differing)}. Call `set_epoch` with the same "
            "epoch and `batches` with the same `batch_size` and `drop_last` on every rank "
            "(or iterate over the sampler on all of them): ranks in different epochs train on "
            "different orders, and ranks with different batch sizes take different numbers of "
            "steps and wait for each other forever."
        )
        raise ValueError(msg)
