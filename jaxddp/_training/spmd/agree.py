"""What the ranks agree on before a step of ``jaxddp.spmd`` runs over their mesh, in one message.

Each call sends one block of :data:`BLOCK` int64 to every rank (a non-blocking
``Iallgather``, given up on after ``JAXDDP_CHECK_TIMEOUT`` seconds):

* the digest of the call's form: the arguments' tree, each leaf's shape, dtype and kind (a
  replicated array of an earlier step, a new array, a Python number). Ranks whose forms
  differ would build global arrays that do not fit together (or programs that do not), so
  every rank raises :class:`jaxddp.TreeMismatchError` naming the first difference;
* a fingerprint of each new value whose sameness on every rank is not known yet (a Python
  number, a new array at a place that has not held a per-rank value): equal on every rank,
  it enters the step replicated; otherwise as this rank's block.

With ``JAXDDP_CHECK=0`` a block is sent only where this rank meets a tree of arguments for
the first time or has fingerprints to send (nothing at all in a steady loop): a rank whose
tree differs at another call raises where it waits (TimeoutError), and jaxddp's exit
handling ends the job.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..._base import settings as _settings
from ..._collectives import signature as _signature

__all__ = ["BLOCK", "agree", "digest", "fingerprint"]

BLOCK = 16  # int64: the digest, the number of fingerprints, up to 14 of them
_HEAD = 2


def fingerprint(x: Any) -> int:
    """64 bits that differ, short of a hash collision, where the values' bits differ (the
    shape and dtype are in the form's digest). A Python number by its value, an array by a
    hash of its bytes (an array on a device is copied to the host once)."""
    if isinstance(x, bool | int):
        if -(2**63) <= x < 2**63:
            return int(x)
        raw = repr(x).encode()
    elif isinstance(x, float):
        return struct.unpack("<q", struct.pack("<d", x))[0]
    elif isinstance(x, complex):
        raw = struct.pack("<dd", x.real, x.imag)
    else:
        raw = np.ascontiguousarray(np.asarray(x)).tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)


def digest(signature: _signature.Signature) -> int:
    """The form's digest: the same on every rank for the same signature."""
    raw = hashlib.blake2b(pickle.dumps(signature, protocol=4), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def agree(
    comm: Any,
    form: int,
    prints: Sequence[int],
    signature: Callable[[], _signature.Signature],
    *,
    always: bool,
    what: str,
    call: str,
) -> np.ndarray | None:
    """Every rank's ``prints`` as the rows of a ``(ranks, len(prints))`` array, once every
    rank has shown the form digest ``form``. Sends nothing (None) where ``always`` is off
    and there are no ``prints``.

    Raises :class:`jaxddp.TreeMismatchError` on every rank where the digests differ
    (``signature()`` names the difference), TimeoutError where a rank does not come."""
    if not always and not prints:
        return None
    size = comm.Get_size()
    send = np.zeros(BLOCK, np.int64)
    send[0] = form
    send[1] = len(prints)
    first = list(prints[: BLOCK - _HEAD])
    send[_HEAD : _HEAD + len(first)] = first
    received = np.empty((size, BLOCK), np.int64)
    request = comm.Iallgather(send, received)
    timeout = _settings.check_timeout()

    def late() -> str:
        return (
            f"Rank {comm.Get_rank()} waited {timeout:g} s for every rank to call {call} "
            "and not every rank arrived: some rank left its loop early (one step less "
            "than the others), runs another branch, or is stuck elsewhere. Give every "
            "rank the same number of steps (`jaxddp.DistributedSampler`, `jaxddp.join`); "
            f"raise the wait with {_signature.TIMEOUT_VARIABLE}=<seconds> if the ranks "
            "are just slow."
        )

    _signature.wait(request, (send, received), timeout, late)
    if not (received[:, 0] == form).all():
        everyone = comm.allgather(signature())
        raise _signature.TreeMismatchError(_signature.mismatch_message(everyone, what))
    if not (received[:, 1] == len(prints)).all():  # not with forms agreed
        counts = ", ".join(f"rank {r}: {int(n)}" for r, n in enumerate(received[:, 1]))
        msg = (
            f"The ranks passed {call} different numbers of new values ({counts}): their "
            "arguments differ. Pass every rank the same tree of arguments (JAXDDP_CHECK=1 "
            "names the first difference)."
        )
        raise _signature.TreeMismatchError(msg)
    rows = received[:, _HEAD : _HEAD + len(first)]
    if len(prints) > len(first):  # many new values (a first call's model): the rest
        rest = np.asarray(prints[len(first) :], np.int64)
        others = np.empty((size, rest.size), np.int64)
        comm.Allgather(rest, others)
        rows = np.concatenate([rows, others], axis=1)
    return rows
