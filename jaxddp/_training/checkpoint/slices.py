"""The sharded optimizer's state in a checkpoint: every rank's slices in a file of its own,
cut anew for the world size that restores them. No MPI here: the ranks' agreement is
:mod:`.sharded`'s.

A :class:`~jaxddp.ShardedState` holds, for each copy of the parameters (adam's ``mu`` and
``nu``) and each dtype group ``g``, this rank's contiguous slice of the group's packed
vector: ``L_g`` real elements padded to a multiple of the world size ``W``, rank ``r``
holding elements ``[r * c_g, (r + 1) * c_g)`` with ``c_g = ceil(L_g / W)``. Such a slice is
an *entry*, named by its path in the state (as the checksums name leaves). On disk::

    <directory>/<step>/                   Orbax's step: the rest of the state, each slice a
                                          0-d placeholder; the metadata describes the slices
    <directory>/<step>.slices/
        rank-00000-of-00004.bin           rank 0's entries, real elements only, one after
        rank-00001-of-00004.bin           the other, in the state's flatten order
        ...

The description in the step's metadata (:func:`describe`) holds the world size, the files
and, per entry, its group, length ``L``, chunk ``c``, dtype and per rank the offset, count
and CRC-32 of its bytes: with it a restore at any world size reads, for its own new slice,
the old ranks' entries that overlap it, and verifies each one it reads.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from typing import Any

import jax
import numpy as np

from ..zero.optimizer import ShardedState
from .trees import DamagedCheckpointError, _key_name, refuse_unshared, restored_like

__all__ = ["BUFFER_BYTES", "FORMAT", "Piece", "describe", "file_name", "merge", "read", "split",
           "write"]  # fmt: skip

FORMAT = 1  # the description's "format": a reader refuses another
BUFFER_BYTES = 16 << 20  # the most bytes of one read or device-to-host copy held at once


@dataclasses.dataclass(frozen=True)
class Piece:
    """One entry of a :class:`ShardedState`: this rank's slice of a dtype group's packed
    vector (``array``: the saved slice, or the restore target's leaf)."""

    path: str  # in the state, as the checksums name leaves
    group: int
    dtype: np.dtype
    length: int  # L: the group's real elements
    size: int  # W: the world size it is cut for
    array: Any

    @property
    def chunk(self) -> int:
        """Elements per rank: ``ceil(L / W)``."""
        return -(-self.length // self.size)

    def count(self, rank: int) -> int:
        """The real (not padding) elements of ``rank``'s slice."""
        return max(0, min(self.chunk, self.length - rank * self.chunk))


def file_name(rank: int, size: int) -> str:
    return f"rank-{rank:05d}-of-{size:05d}.bin"


def _name(path: tuple[Any, ...]) -> str:
    return "/".join(_key_name(k) for k in path)


# -- the tree: slices out, slices back in -----------------------------------------------------


def split(storable: Any) -> tuple[Any, list[Piece]]:
    """``storable`` with every slice of its ShardedStates replaced by a 0-d placeholder of
    its dtype (Orbax stores the rest, the replicated leaves of a ShardedState included, and a
    target split alike matches it), and the slices as pieces, in flatten order."""
    pieces: list[Piece] = []

    def cut(path: tuple[Any, ...], node: Any) -> Any:
        if not isinstance(node, ShardedState):
            return node
        slicing = node.slicing
        flat, treedef = jax.tree_util.tree_flatten_with_path(node.inner)
        if slicing is None or len(slicing.groups) != len(flat):
            msg = (
                f"The ShardedState at `{_name(path) or '/'}` does not say how it is sliced: a "
                "checkpoint saves the state that `shard_optimizer`'s init or update returned "
                "(not one rebuilt as `ShardedState(inner)`)."
            )
            raise ValueError(msg)
        leaves = []
        for (inner_path, leaf), group in zip(flat, slicing.groups, strict=True):
            if group < 0:
                leaves.append(leaf)
                continue
            dtype = np.dtype(leaf.dtype)
            name = _name((*path, jax.tree_util.GetAttrKey("inner"), *inner_path))
            piece = Piece(name, group, dtype, slicing.lengths[group], slicing.size, leaf)
            shape = tuple(np.shape(leaf))  # an empty slice: to_storable's 0-d placeholder
            if shape != (piece.chunk,) and not (piece.chunk == 0 and shape == ()):
                msg = (
                    f"The slice at `{name}` has shape {shape}, but its group of "
                    f"{piece.length} elements over {piece.size} ranks gives ({piece.chunk},)."
                )
                raise ValueError(msg)
            pieces.append(piece)
            leaves.append(np.zeros((), dtype))
        return ShardedState(jax.tree_util.tree_unflatten(treedef, leaves), slicing)

    tree = jax.tree_util.tree_map_with_path(
        cut, storable, is_leaf=lambda x: isinstance(x, ShardedState)
    )
    return tree, pieces


def merge(tree: Any, wanted: list[Piece], arrays: list[Any]) -> Any:
    """``tree`` (as :func:`split` left it) with its placeholders replaced by ``arrays``, one
    per wanted piece, each in the kind of the target's leaf (a jax array for a jax array)."""
    values = {p.path: restored_like(a, p.array) for p, a in zip(wanted, arrays, strict=True)}

    def fill(path: tuple[Any, ...], node: Any) -> Any:
        if not isinstance(node, ShardedState) or node.slicing is None:
            return node
        flat, treedef = jax.tree_util.tree_flatten_with_path(node.inner)
        leaves = [
            values[_name((*path, jax.tree_util.GetAttrKey("inner"), *inner_path))]
            if group >= 0
            else leaf
            for (inner_path, leaf), group in zip(flat, node.slicing.groups, strict=True)
        ]
        return ShardedState(jax.tree_util.tree_unflatten(treedef, leaves), node.slicing)

    return jax.tree_util.tree_map_with_path(
        fill, tree, is_leaf=lambda x: isinstance(x, ShardedState)
    )


# -- writing ----------------------------------------------------------------------------------


def _host_parts(array: Any, count: int, buffer_bytes: int) -> Any:
    """The first ``count`` elements of a 1-D array as C-ordered byte views, at most
    ``buffer_bytes`` each: a NumPy (or host) array without a copy, a device array copied
    to the host one part at a time."""
    itemsize = np.dtype(array.dtype).itemsize
    step = max(1, buffer_bytes // itemsize)
    on_host = isinstance(array, np.ndarray) or (
        isinstance(array, jax.Array) and all(d.platform == "cpu" for d in array.devices())
    )
    if on_host:
        whole = np.ascontiguousarray(np.asarray(array).reshape(-1)[:count])
        for a in range(0, count, step):
            yield whole[a : a + step].view(np.uint8).data
        return
    for a in range(0, count, step):
        yield np.ascontiguousarray(np.asarray(array[a : min(count, a + step)])).view(np.uint8).data


def write(folder: str, rank: int, size: int, pieces: list[Piece], *,
          buffer_bytes: int = BUFFER_BYTES) -> dict[str, Any]:  # fmt: skip
    """Writes this rank's pieces (their real elements, one after the other) to its file in
    ``folder``, flushed and synced, and returns its index: the file's name and per piece its
    path, offset, dtype, count and CRC-32. Holds the pieces and at most one buffer."""
    name = file_name(rank, size)
    entries, offset = [], 0
    with open(os.path.join(folder, name), "wb") as f:
        for piece in pieces:
            if piece.size != size:
                msg = f"The slice at `{piece.path}` is cut for {piece.size} ranks, not {size}."
                raise ValueError(msg)
            count, crc = piece.count(rank), 0
            for part in _host_parts(piece.array, count, buffer_bytes):
                f.write(part)
                crc = zlib.crc32(part, crc)
            entries.append(
                {"path": piece.path, "offset": offset, "dtype": piece.dtype.name,
                 "count": count, "crc32": crc}
            )  # fmt: skip
            offset += count * piece.dtype.itemsize
        f.flush()
        os.fsync(f.fileno())
    return {"file": name, "bytes": offset, "entries": entries}


def describe(indices: list[dict[str, Any]], pieces: list[Piece]) -> dict[str, Any]:
    """What the step's metadata holds of the slices (JSON): the world size, every rank's file
    (``indices``, in rank order, from :func:`write`) and per entry (``pieces``: any rank's,
    the same on every rank but for the arrays) its group, length, chunk, dtype and per rank
    the offset, count and CRC-32 of its bytes."""
    size = len(indices)
    entries = {}
    for i, piece in enumerate(pieces):
        ranks = []
        for rank, index in enumerate(indices):
            e = index["entries"][i]
            if e["path"] != piece.path or e["count"] != piece.count(rank):
                msg = (
                    f"Rank {rank} wrote `{e['path']}` ({e['count']} elements) where "
                    f"`{piece.path}` ({piece.count(rank)} elements) was expected."
                )
                raise ValueError(msg)
            ranks.append({"offset": e["offset"], "count": e["count"], "crc32": e["crc32"]})
        entries[piece.path] = {
            "group": piece.group, "length": piece.length, "chunk": piece.chunk,
            "dtype": piece.dtype.name, "ranks": ranks,
        }  # fmt: skip
    return {
        "format": FORMAT,
        "world_size": size,
        "files": [index["file"] for index in indices],
        "entries": entries,
    }


# -- reading ----------------------------------------------------------------------------------


def check_wanted(meta: dict[str, Any], wanted: list[Piece], step: int) -> None:
    """Raises ValueError naming the first entry that the saved slices and the target's do
    not share, or whose length or dtype differs."""
    saved = meta["entries"]
    refuse_unshared(step, saved.keys(), {p.path for p in wanted}, noun="a sharded optimizer slice")
    for piece in wanted:
        entry = saved[piece.path]
        for what, got, want in (
            ("elements", entry["length"], piece.length),
            ("dtype", entry["dtype"], piece.dtype.name),
        ):
            if got != want:
                msg = (
                    f"Checkpoint {step} holds the sharded optimizer slice `{piece.path}` with "
                    f"{what} {got}, but the target has {what} {want}: it is a checkpoint of "
                    "another state (another model, another parameter dtype)."
                )
                raise ValueError(msg)


def read(folder: str, meta: dict[str, Any], wanted: list[Piece], *, rank: int, size: int,
         step: int, buffer_bytes: int = BUFFER_BYTES) -> list[np.ndarray]:  # fmt: skip
    """This rank's slice of every wanted entry at world size ``size`` (the padding beyond
    ``L`` zeros), assembled from the saved ranks' entries that overlap it. Each entry read
    is read whole, in parts of at most ``buffer_bytes``, and verified against its CRC-32:
    a bad checksum, a missing or short file is a :class:`DamagedCheckpointError` naming the
    step, the file and the entry. Holds the slices and one buffer."""
    try:
        if meta.get("format") != FORMAT or not all(
            os.path.basename(name) == name for name in meta["files"]
        ):
            raise TypeError(meta.get("format"))
        check_wanted(meta, wanted, step)
        largest = max(
            (
                r["count"] * p.dtype.itemsize
                for p in wanted
                for r in meta["entries"][p.path]["ranks"]
            ),
            default=0,
        )
    except (AttributeError, KeyError, TypeError, IndexError) as e:
        msg = (
            f"Checkpoint {step} is damaged: its metadata's description of the sharded "
            f"optimizer's slices is missing or unreadable ({type(e).__name__}: {e})."
        )
        raise DamagedCheckpointError(msg) from e
    reader = _Reader(folder, meta, step, np.empty(max(16, min(buffer_bytes, largest)), np.uint8))
    try:
        out = []
        for piece in wanted:
            chunk = -(-piece.length // size)
            mine = np.zeros((chunk,), piece.dtype)
            lo, hi = rank * chunk, min(piece.length, (rank + 1) * chunk)
            old = meta["entries"][piece.path]["chunk"]
            if lo < hi and old > 0:
                for j in range(lo // old, (hi - 1) // old + 1):
                    reader.copy(piece, j, mine, lo, hi)
            out.append(mine)
        return out
    finally:
        reader.close()


class _Reader:
    """The saved files, opened once each, and the one buffer their entries are read with."""

    def __init__(self, folder: str, meta: dict[str, Any], step: int, buffer: np.ndarray) -> None:
        self.folder, self.meta, self.step, self.buffer = folder, meta, step, buffer
        self.files: dict[int, Any] = {}

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def open(self, j: int, where: str) -> Any:
        if j not in self.files:
            try:
                self.files[j] = open(os.path.join(self.folder, self.meta["files"][j]), "rb")  # noqa: SIM115
            except OSError as e:
                msg = f"Checkpoint {self.step} is damaged: {where} cannot be read ({e.strerror})."
                raise DamagedCheckpointError(msg) from e
        return self.files[j]

    def copy(self, piece: Piece, j: int, mine: np.ndarray, lo: int, hi: int) -> None:
        """Reads saved rank ``j``'s entry of ``piece`` whole, checks its CRC-32, and copies
        the elements in ``[lo, hi)`` of the group's vector into ``mine`` (which starts at
        ``lo``)."""
        entry = self.meta["entries"][piece.path]
        saved = entry["ranks"][j]
        where = (
            f"`{piece.path}` in {self.meta['files'][j]} (rank {j}'s file of "
            f"{self.meta['world_size']})"
        )
        f = self.open(j, where)
        f.seek(saved["offset"])
        itemsize = piece.dtype.itemsize
        start = j * entry["chunk"]  # the entry's first element in the group's vector
        nbytes, step_bytes = saved["count"] * itemsize, self.buffer.size // itemsize * itemsize
        crc, done = 0, 0
        while done < nbytes:
            want = min(step_bytes, nbytes - done)
            n = f.readinto(self.buffer.data[:want])  # buffered: short only at the end
            if n < want:
                msg = (
                    f"Checkpoint {self.step} is damaged: {where} is cut short (the file ends "
                    f"{nbytes - done - n} bytes before the entry does)."
                )
                raise DamagedCheckpointError(msg)
            part = self.buffer[:n]
            crc = zlib.crc32(part.data, crc)
            first = start + done // itemsize  # the part's first element in the group's vector
            a, b = max(lo, first), min(hi, first + n // itemsize)
            if a < b:
                mine[a - lo : b - lo] = part.view(piece.dtype)[a - first : b - first]
            done += n
        if crc != saved["crc32"]:
            msg = (
                f"Checkpoint {self.step} is damaged: the slice {where} fails the checksum saved "
                f"with it (CRC-32 {crc:08x}, saved {saved['crc32']:08x}); the file was changed "
                "or corrupted after the save."
            )
            raise DamagedCheckpointError(msg)
