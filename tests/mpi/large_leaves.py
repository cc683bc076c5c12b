"""Shared by test_large_leaves_jit.py and test_large_leaves_host.py: a leaf of more than
2**31 elements, on 2 real ranks: MPI counts are C ints, so such a leaf
travels in chunks of at most ``MAX_COUNT`` elements (an MPI call with the whole count would
end the job inside MPICH).

Each test holds 4 to 6 GiB per rank, so this module runs at 2 ranks only, with 1-byte
leaves, and frees them before the next test. Values depend on the position (``i % 256``),
so a chunk put back at the wrong offset shows; they are checked around the chunk border
and past 2**31.
"""

import gc

import jax
import numpy as np
import pytest

import jaxddp
from jaxddp._collectives.wire import MAX_COUNT

rank = jaxddp.rank()
size = jaxddp.world_size()

N = 2**31 + 256  # a multiple of 256: the pattern is a tile
WINDOWS = [(0, 4), (MAX_COUNT - 3, MAX_COUNT + 3), (2**31, 2**31 + 5), (N - 4, N)]


@pytest.fixture(autouse=True)
def free_memory():
    yield
    gc.collect()


def _pattern(xp):
    """``i % 256`` for every position i of the big leaf, as uint8."""
    return xp.tile(xp.arange(256, dtype=xp.uint8), N // 256)


def _flags(xp):
    """``(_pattern(xp) + rank) % 3 == 0`` (uint8 arithmetic), built by tiling its period of 256
    positions: NumPy's ``%`` over 2**31 uint8 values took 5.6 s per rank."""
    return xp.tile((xp.arange(256, dtype=xp.uint8) + xp.uint8(rank)) % 3 == 0, N // 256)


def _windows(x):
    """The values at WINDOWS: static slices (jit's integer indices are int32)."""
    return [
        jax.lax.slice(x, (a,), (b,)) if isinstance(x, jax.Array) else x[a:b] for a, b in WINDOWS
    ]


def _expected_sum():
    return [
        ((np.arange(a, b) % 256) * size + sum(range(size))).astype(np.uint8) for a, b in WINDOWS
    ]


def _expected_broadcast(root):
    return [(np.arange(a, b) % 256 + root) % 256 % 3 == 0 for a, b in WINDOWS]


def _check(got, want):
    assert len(got) == len(want)
    for (a, b), g, w in zip(WINDOWS, got, want, strict=True):
        assert np.asarray(g).dtype == w.dtype, (a, b)
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"positions {a}..{b}")
