"""Leaves past 2**31 elements inside jax.jit, on 2 real ranks (one launch with
test_large_leaves_host.py: the harness's watchdog limits each test, not the launch)."""

import jax
import jax.numpy as jnp

import jaxddp
from tests.mpi.large_leaves import (  # noqa: F401 - free_memory is an autouse fixture
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


def test_allreduce_of_a_leaf_past_2_31_elements_under_jit():
    def step():
        big = _pattern(jnp) + jnp.uint8(rank)
        return _windows(jaxddp.allreduce({"big": big}, "sum")["big"])

    _check(jax.jit(step)(), _expected_sum())


def test_broadcast_of_a_bool_leaf_past_2_31_elements_under_jit():
    def step():
        flags = _flags(jnp)
        return _windows(jaxddp.broadcast({"flags": flags}, root=1)["flags"])

    _check(jax.jit(step)(), _expected_broadcast(root=1))
