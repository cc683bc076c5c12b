"""What a checkpoint holds and how it is checked: a state as Orbax can store it, the CRC-32
of every array and their verification, the comparison of a saved tree with the target it is
restored into (where a state of one entry per rank, as ``jaxddp.join``'s, was saved on
another number of ranks, it says so), and a restored leaf put back in the target's kind."""

from __future__ import annotations

import concurrent.futures
import os
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._collectives import api as _comm
from ..._collectives.dtypes import is_key_dtype
from ..._types import PyTree

__all__ = [
    "METADATA_KEY",
    "DamagedCheckpointError",
    "check_matches",
    "checksums",
    "refuse_other_world",
    "refuse_unshared",
    "restored_like",
    "saved_numbers",
    "to_storable",
    "verify",
]


METADATA_KEY = "jaxddp"  # in Orbax's custom metadata of a step: {"crc32": {path: crc}}


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


def to_storable(tree: PyTree) -> Any:
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


def _crc32(leaf: Any) -> int | None:
    """The CRC-32 of an array leaf's bytes (C order); None for Python numbers."""
    if isinstance(leaf, bool | int | float | complex | str):
        return None
    array = np.ascontiguousarray(np.asarray(leaf))
    data: Any = array.reshape(-1).view(np.uint8)  # a buffer: zlib reads it without a copy
    return zlib.crc32(data if array.size else b"")


def checksums(storable: Any) -> dict[str, int]:
    """``{path: crc32}`` for every array leaf of a storable state. zlib releases the GIL
    while it hashes, so the leaves are hashed on a few threads at once."""
    leaves = _by_path(storable)
    workers = min(4, os.cpu_count() or 1, max(1, len(leaves)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        crcs = list(pool.map(_crc32, leaves.values()))
    return {"/".join(path): crc for path, crc in zip(leaves, crcs, strict=True) if crc is not None}


def saved_numbers(metadata: Any) -> frozenset[str]:
    """The paths of the leaves that Orbax's metadata of a step says were saved as Python
    numbers: they carry no checksum."""
    return frozenset(
        "/".join(path)
        for path, leaf in _by_path(metadata).items()
        if type(leaf).__name__ == "ScalarMetadata"  # orbax.checkpoint.metadata's
    )


def verify(restored: Any, custom: Any, step: int, *, numbers: frozenset[str],
           allow_missing: bool) -> bool:  # fmt: skip
    """Raises DamagedCheckpointError naming the first array whose bytes fail the checksum
    saved with it, or that has none. A step whose metadata holds no checksums at all (cut
    short, unreadable, or written before jaxddp had them) is damaged too, unless
    ``allow_missing``: then it passes unverified and False is returned."""
    entry = custom.get(METADATA_KEY) if isinstance(custom, dict) else None
    saved = entry.get("crc32") if isinstance(entry, dict) else None
    if not isinstance(saved, dict):
        if allow_missing:
            return False
        msg = (
            f"Checkpoint {step} is damaged: its metadata (`_CHECKPOINT_METADATA`) holds no "
            "checksums of jaxddp: it is unreadable, cut short, or lacks jaxddp's entry. A "
            "checkpoint written before jaxddp saved checksums has none either: restore one "
            "you trust with `restore(..., allow_missing_checksums=True)`."
        )
        raise DamagedCheckpointError(msg)
    for path, leaf in _by_path(restored).items():
        name = "/".join(path)
        crc, want = _crc32(leaf), saved.get(name)
        if crc is None or (want is None and name in numbers):
            continue  # a Python number: saved without a checksum
        if isinstance(want, bool) or not isinstance(want, int):
            msg = (
                f"Checkpoint {step} is damaged: its metadata holds no checksum for "
                f"`{_path_text(path)}` (it has {want!r}); it was changed after the save."
            )
            raise DamagedCheckpointError(msg)
        if want != crc:
            msg = (
                f"Checkpoint {step} is damaged: the values read for `{_path_text(path)}` fail "
                f"the checksum saved with them (CRC-32 {crc:08x}, saved {want:08x}); "
                "its files were changed or corrupted after the save."
            )
            raise DamagedCheckpointError(msg)
    return True


def _key_name(key: Any) -> str:
    for field in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey, ...
        if hasattr(key, field):
            return str(getattr(key, field))
    return str(key)


def _by_path(tree: PyTree) -> dict[tuple[str, ...], Any]:
    """Leaves by their path as names: a dict, a dataclass and Orbax's metadata of either
    name their entries alike."""
    tree = getattr(tree, "tree", tree)  # Orbax's TreeMetadata holds the tree
    return {
        tuple(map(_key_name, path)): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _path_text(path: tuple[str, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path)


def refuse_unshared(step: int, saved: Any, target: Any, *, noun: str,
                    show: Any = str) -> None:  # fmt: skip
    """Raises ValueError naming the first of the keys that the saved checkpoint and the
    target do not share: ``noun`` says what they are, ``show`` writes one."""
    for path in sorted(saved ^ target):
        has, lacks = ("checkpoint", "target") if path in saved else ("target", "checkpoint")
        msg = (
            f"Checkpoint {step} does not match the target: the {has} has {noun} "
            f"`{show(path)}` that the {lacks} lacks. It is a checkpoint of another state "
            "(another model, another optimizer)."
        )
        raise ValueError(msg)


def refuse_other_world(step: int, saved: Any, target: dict[tuple[str, ...], Any]) -> None:
    """Raises ValueError naming a state of one entry per rank saved on another number of
    ranks than the target's. Such a state says so by its shape: an int ``world_size``
    beside a ``ranks`` list of that many entries (the state of ``jaxddp.join``: each rank's
    own stream, which cannot be divided among more ranks or merged into fewer). ``saved``
    holds the checkpoint's paths, ``target`` the target's leaves by path."""
    for path, world in target.items():
        if path[-1] != "world_size" or isinstance(world, bool) or not isinstance(world, int):
            continue
        ranks = (*path[:-1], "ranks")
        had, has = (
            {p[len(ranks)] for p in paths if p[: len(ranks)] == ranks and len(p) > len(ranks)}
            for paths in (saved, target)
        )
        if had and len(has) == world and len(had) != world:
            msg = (
                f"Checkpoint {step} holds at `{_path_text(path[:-1])}` a state saved on "
                f"{len(had)} ranks (one entry per rank under `ranks`, as the state of "
                f"`jaxddp.join` has), but the target's is one of {world} ranks, as this job "
                "has: each rank's stream belongs to its rank (its own files, filters, "
                "packing), so its position cannot be divided among more ranks or merged into "
                f"fewer. Resume on {len(had)} ranks, or start the streams anew."
            )
            raise ValueError(msg)


def check_matches(saved: Any, target: Any, step: int) -> None:
    """Raises ValueError naming the first entry that the saved tree (restored leaves, or
    Orbax's metadata of them) and the target do not share, or whose shape or dtype differs
    (Orbax compares the structures, not always the shapes)."""
    got, want = _by_path(saved), _by_path(target)
    refuse_other_world(step, got.keys(), want)
    refuse_unshared(step, got.keys(), want.keys(), noun="an entry", show=_path_text)
    for path, b in want.items():
        a = got[path]
        if isinstance(b, bool | int | float) and _shape(a) == ():
            if _dtype(a).kind in _number_kinds(b):
                continue  # a Python number takes a saved 0-d leaf of its kind
            msg = (
                f"Checkpoint {step} holds a number of dtype {_dtype(a)} at `{_path_text(path)}`, "
                f"but the target has a Python {type(b).__name__} ({np.asarray(b).dtype}) there: "
                "restore does not convert. Give the target the saved kind of number, or convert "
                "after restoring."
            )
            raise ValueError(msg)
        if _describe(a)[:2] == _describe(b)[:2]:
            continue
        if _describe(a)[0] == _describe(b)[0] and len(_describe(b)) == 2:  # the dtype alone
            msg = (
                f"Checkpoint {step} holds {_describe(a)[1]} at `{_path_text(path)}`, but the "
                f"target has {_describe(b)[1]} there (shape {_describe(b)[0]}): restore does not "
                "convert. Give the target the saved dtype, or convert after restoring."
            )
            raise ValueError(msg)
        msg = (
            f"Checkpoint {step} holds {_describe(a)} at "
            f"`{_path_text(path)}`, but the target has {_describe(b)} "
            "there: it is a checkpoint of another state."
        )
        raise ValueError(msg)


def _number_kinds(number: float) -> str:
    """The dtype kinds that a Python number of the target takes from a saved 0-d leaf."""
    return "b" if isinstance(number, bool) else "iu" if isinstance(number, int) else "f"


def _dtype(leaf: Any) -> np.dtype[Any]:
    """The dtype of an array, of Orbax's metadata of one, or of a Python number."""
    dtype = getattr(leaf, "dtype", None)
    return np.asarray(leaf).dtype if dtype is None else np.dtype(dtype)


def restored_like(value: Any, target: Any) -> Any:
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
