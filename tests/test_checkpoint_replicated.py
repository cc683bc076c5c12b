"""The fingerprint that a save compares across ranks (jaxddp/_training/checkpoint/replicated.py),
in one process: every change a rank's copy of a replicated leaf may have is seen, and the host
copy it is taken of reuses the last copy's buffers. On real ranks: tests/mpi/test_checkpoint.py
and tests/mpi/test_sharded.py."""

import copy

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxddp._training.checkpoint.replicated import COLUMNS, fingerprint, hold

RNG = np.random.default_rng(0)
BIG = RNG.standard_normal(3 * COLUMNS * 2 + 5).astype(np.float32)  # rows, and a tail


def _swapped(a, i, j):
    b = a.copy()
    b[i], b[j] = a[j], a[i]
    return b


@pytest.mark.parametrize(
    ("i", "j"),
    [(0, 1), (0, 2), (0, 2 * COLUMNS), (3, 2 * COLUMNS + 7), (0, BIG.size - 1)],
    ids=["within a word", "same row", "same column", "elsewhere", "into the tail"],
)
def test_two_elements_swapped_are_seen(i, j):
    assert fingerprint(_swapped(BIG, i, j)) != fingerprint(BIG)


def test_one_bit_anywhere_is_seen():
    base = fingerprint(BIG)
    for i in RNG.integers(0, BIG.size, 50):
        b = BIG.copy()
        b.view(np.uint32)[i] ^= np.uint32(1 << int(RNG.integers(32)))
        assert fingerprint(b) != base


@pytest.mark.parametrize("width", [COLUMNS, 64, 1000])
def test_rows_of_a_matrix_in_another_order_are_seen(width):
    # each rank's own shuffle of the same samples, saved as if replicated
    m = RNG.standard_normal((40, width)).astype(np.float64)
    assert fingerprint(m[::-1]) != fingerprint(m)
    assert fingerprint(m[RNG.permutation(40)]) != fingerprint(m)


@pytest.mark.parametrize(
    "leaf",
    [np.arange(13, dtype=np.int8), np.array([True, False, True]), np.zeros(5, ml_dtypes.bfloat16),
     np.float32(2.5), jnp.arange(7.0)],
    ids=["int8", "bool", "bfloat16", "numpy scalar", "jax"],
)  # fmt: skip
def test_small_and_narrow_leaves_equal_themselves_and_not_a_change(leaf):
    same = np.array(leaf, copy=True)
    assert fingerprint(same) == fingerprint(leaf)
    changed = same.reshape(-1).view(np.uint8).copy()
    changed[-1] ^= 1
    assert fingerprint(changed.view(same.dtype).reshape(same.shape)) != fingerprint(leaf)


def test_python_numbers_compare_by_type_and_value():
    assert fingerprint(3) == fingerprint(3)
    assert fingerprint(3) != fingerprint(4)
    assert fingerprint(3) != fingerprint(3.0)
    assert fingerprint(0.0) != fingerprint(-0.0)


def test_a_host_copy_reuses_an_earlier_copys_buffers_and_holds_the_new_values():
    # A background save copies into the last save's buffers (settled, so free): no fresh
    # pages. Where a shape or dtype differs, that leaf gets new memory.
    first = {"w": np.arange(6.0), "b": np.zeros(3, np.float32), "n": 3}
    earlier, error = hold(first, copy=True)
    assert error is None
    state = {"w": np.arange(6.0) + 1, "b": np.ones(4, np.float32), "n": 4}
    held, error = hold(state, copy=True, into=earlier)
    assert error is None
    assert held["w"] is earlier["w"]  # the same buffer, the new values
    np.testing.assert_array_equal(held["w"], state["w"])
    assert held["b"] is not earlier["b"]  # another shape: new memory
    np.testing.assert_array_equal(held["b"], state["b"])
    assert held["n"] == 4
    state["w"][:] = -1.0  # the copy is its own
    np.testing.assert_array_equal(held["w"], np.arange(6.0) + 1)
    other, _ = hold({"x": np.arange(6.0)}, copy=True, into=earlier)  # another structure
    assert other["x"] is not earlier["w"]
    # the save's own: Orbax's guard against a caller changing it (a deep copy of every
    # host array, the whole state again) keeps it as it is; the caller's arrays are copied
    assert copy.deepcopy(held["w"]) is held["w"]
    assert copy.deepcopy(state["w"]) is not state["w"]
