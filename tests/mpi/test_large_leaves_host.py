"""Leaves past 2**31 elements on concrete values (NumPy and mpi4py), on 2 real ranks."""

import numpy as np

import jaxddp
from tests.mpi.large_leaves import (  # noqa: F401 - free_memory is an autouse fixture
    N,
    _check,
    _expected_broadcast,
    _expected_sum,
    _flags,
    _pattern,
    _windows,
    free_memory,
    rank,
)

MPI_SIZES = (2,)  # 4 to 6 GiB per rank: see tests/mpi/large_leaves.py
MPI_GROUP = "large-leaves"  # one launch of their own, which frees that memory at its end
MPI_OPTIMIZED = True  # GiB reduced in compiled loops: LLVM's optimizations pay


def test_allreduce_of_a_leaf_past_2_31_elements_on_concrete_values():
    big = _pattern(np)
    big += np.uint8(rank)
    out = jaxddp.allreduce({"big": big}, "sum")["big"]
    assert out.shape == (N,)
    del big
    _check(_windows(out), _expected_sum())


def test_broadcast_of_a_bool_leaf_past_2_31_elements_on_concrete_values():
    flags = _flags(np)
    out = jaxddp.broadcast({"flags": flags}, root=1)["flags"]
    del flags
    assert out.shape == (N,)
    _check(_windows(out), _expected_broadcast(root=1))
