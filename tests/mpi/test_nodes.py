"""Ranks on two nodes (2 x 2): what depends on the node layout.

MPICH's hydra simulates the nodes on this machine (``MPI_HOSTS``: its fork launcher, each
host a shared-memory node of its own, TCP between them), so the code for jobs that span
nodes runs here: local ranks, the handler choice (jitted reductions through MPI, not the
shared memory of one node), the values of jitted and eager collectives, and the digits
example's model, identical on every rank.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import jaxddp

MPI_SIZES = (4,)
MPI_HOSTS = "n0:2,n1:2"

rank = jaxddp.rank()
size = jaxddp.world_size()
WORLD = MPI.COMM_WORLD


def test_every_rank_knows_its_node_and_its_local_rank():
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    layout = WORLD.allgather((jaxddp.local_rank(), node.Get_size(), MPI.Get_processor_name()))
    node.Free()
    assert [local for local, _, _ in layout] == [0, 1, 0, 1]
    assert {n for _, n, _ in layout} == {2}


def test_jitted_reductions_go_through_mpi_across_nodes():
    from jaxddp import _native

    assert _native.shared_calls() is None  # no memory shared across nodes
    assert "in memory they share" not in _native.status()


def _part(r, dtype, n):
    values = np.arange(n) * (r + 1) - 3 * r
    return values.astype(dtype)


DTYPES = [np.float32, np.int32, np.uint8, np.complex64]


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("n", [5, 300_000], ids=["small", "large"])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_values_across_nodes_are_every_ranks(op, n, jitted):
    got = {}
    for dtype in DTYPES:
        if np.dtype(dtype).kind == "c" and op in ("max", "min"):
            continue
        x = _part(rank, dtype, n)
        if jitted:
            out = jax.jit(lambda x, op=op: jaxddp.allreduce(x, op=op))(jnp.asarray(x))
        else:
            out = jaxddp.allreduce(x, op=op)
        got[np.dtype(dtype).name] = np.asarray(out)
    parts = {d: [_part(r, d, n) for r in range(size)] for d in DTYPES}
    for dtype in DTYPES:
        name = np.dtype(dtype).name
        if name not in got:
            continue
        stack = np.stack(parts[dtype])
        if op == "sum":
            with np.errstate(over="ignore"):
                expected = stack.sum(0, dtype=dtype)
        elif op == "mean":
            expected = stack.astype(np.complex128 if name == "complex64" else np.float64).mean(0)
        else:
            expected = getattr(stack, op)(0)
        np.testing.assert_allclose(got[name], expected, rtol=1e-6, err_msg=f"{name} {op}")


def test_the_digits_example_trains_one_model_on_every_rank():
    from jaxddp.examples import digits

    assert digits.main(["--epochs", "2"]) == 0  # 0: the model is identical on every rank


def test_join_over_uneven_streams_trains_exactly_across_nodes():
    """The docs' per-rank-stream example: its bytes of every step cross the nodes."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "examples" / "uneven_streams.py"
    spec = importlib.util.spec_from_file_location("uneven_streams_nodes", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    params, reference = example.main(), example.one_process(size)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
