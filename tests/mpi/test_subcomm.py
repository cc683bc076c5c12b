"""`comm=` honoured everywhere: every collective and every check runs on the communicator given.

On 3 real ranks, the sub-communicator holds ranks 0 and 1; rank 2 is left out and does
something else meanwhile (local work, or the same call on ``COMM_SELF``). Before `comm=` was
honoured, the tree check of ``allreduce_gradients(comm=sub, check=True)`` ran over the whole
world and waited for rank 2. Every test computes its expectation from the ranks' numbers and
asserts after its collectives, so that a failing assertion never leaves a rank waiting.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpi4py import MPI

import jaxddp

MPI_SIZES = (3,)

rank = jaxddp.rank()
size = jaxddp.world_size()
OUT = size - 1  # the rank left out of `sub`
MEMBERS = list(range(size - 1))
member = rank != OUT
sub = MPI.COMM_WORLD.Split(0 if member else MPI.UNDEFINED, key=rank)


def test_sub_has_every_rank_but_the_last():
    if member:
        assert (sub.Get_size(), sub.Get_rank()) == (len(MEMBERS), rank)
    else:
        assert sub == MPI.COMM_NULL


def test_allreduce_gradients_with_check_on_a_sub_communicator():
    tx = optax.chain(jaxddp.allreduce_gradients(comm=sub, check=True), optax.sgd(1.0))
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    if member:
        grads = {"w": jnp.full(3, rank + 1.0), "b": jnp.float32(10.0 * rank)}
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        expected_w = -np.mean([r + 1.0 for r in MEMBERS])
        expected_b = -np.mean([10.0 * r for r in MEMBERS])
        np.testing.assert_allclose(np.asarray(updates["w"]), [expected_w] * 3)
        assert float(updates["b"]) == pytest.approx(expected_b)
    else:  # something else: a local update over no communicator at all
        local = jaxddp.resolve_unused_parameters({"w": jnp.ones(3)}, params)
        assert float(local["b"]) == 0.0


def test_the_tree_check_on_a_sub_communicator_names_a_real_mismatch():
    tx = jaxddp.allreduce_gradients(comm=sub, check=True)
    if member:
        grads = {"w": jnp.ones(3)} if rank == 0 else {"w": jnp.ones(4)}
        with pytest.raises(jaxddp.TreeMismatchError) as info:
            tx.update(grads, tx.init(None))
        message = " ".join(str(info.value).split())
        assert "differs across ranks at `['w']`" in message
        assert "rank 0 has float32[3], rank 1 has float32[4]" in message
    else:
        assert jaxddp.world_size() == size


def test_synchronize_on_a_sub_communicator():
    tree = {"w": jnp.full(2, float(rank)), "name": f"rank {rank}"}
    if member:
        root = len(MEMBERS) - 1  # the last member, rank 1
        out = jaxddp.synchronize(tree, root=root, comm=sub)
        assert out["w"].tolist() == [float(root), float(root)]
        assert out["name"] == f"rank {rank}"  # not an array: unchanged
    else:  # the same call on a communicator of its own
        out = jaxddp.synchronize(tree, comm=MPI.COMM_SELF)
        assert out["w"].tolist() == [float(rank), float(rank)]


def test_masked_mean_on_a_sub_communicator():
    values = jnp.array([float(rank), 1000.0, float(rank) + 1.0])
    mask = jnp.array([True, False, True])
    if member:
        got = jax.jit(lambda v, m: jaxddp.masked_mean(v, m, comm=sub))(values, mask)
        expected = np.mean([x for r in MEMBERS for x in (r, r + 1.0)])
        assert float(got) == pytest.approx(expected)
    else:
        got = jaxddp.masked_mean(values, mask, comm=MPI.COMM_SELF)
        assert float(got) == pytest.approx(rank + 0.5)


def test_sampler_on_a_sub_communicator():
    n = 7
    if member:
        sampler = jaxddp.DistributedSampler(n, shuffle=False, comm=sub)
        per_rank = -(-n // len(MEMBERS))
        order = [i % n for i in range(per_rank * len(MEMBERS))]
        assert (sampler.num_replicas, sampler.rank) == (len(MEMBERS), rank)
        assert sampler.indices().tolist() == order[rank :: len(MEMBERS)]  # interleaved
        # load_state_dict checks over the sub communicator only: the others never join
        w = len(MEMBERS)
        state = {**sampler.state_dict(), "position": w * (rank + 1)}
        if w > 1:
            with pytest.raises(ValueError, match=rf"`position` \(rank 0: {w}, rank 1: {2 * w}"):
                sampler.load_state_dict(state)
        sampler.load_state_dict({**state, "position": w})
    else:  # a pure sampler of its own: no communicator
        sampler = jaxddp.DistributedSampler(n, num_replicas=1, rank=0, shuffle=False)
        assert sampler.indices().tolist() == list(range(n))


def test_sampler_argument_check_on_a_sub_communicator_names_the_difference():
    if member:
        with pytest.raises(ValueError, match="`seed` \\(rank 0: 0, rank 1: 1\\)"):
            jaxddp.DistributedSampler(10, seed=rank, comm=sub)
    else:
        assert jaxddp.rank() == OUT
