"""``reduce_scatter`` and ``all_gather`` on real ranks (2, 3 and 4), on every path: inside
``jax.jit`` and outside it (MPI), and inside ``jaxddp.spmd`` (in the ``xla`` variant, at 2 and
4 ranks, JAX's ``psum_scatter`` and ``all_gather``; elsewhere ``jax.jit`` again).

Every rank builds every rank's tree from its seed, so each expectation is a NumPy reference:
a reduce-scatter through MPI is the sum of the ranks' blocks in rank order, to the bit; on
the xla path XLA orders its float sums itself (to rounding), and integers are exact. Integer
and boolean leaves also equal the matching block of ``jaxddp.allreduce`` on the same path
(the same dtype rules), and a gather gives every rank's bits back.
"""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxddp

MPI_SIZES = (2, 3, 4)
MPI_VARIANTS = {"xla": {"JAXDDP_COLLECTIVES": "xla"}}
MPI_VARIANT_SIZES = {"xla": (2, 3, 4)}

rank = jaxddp.rank()
size = jaxddp.world_size()
XLA = os.environ.get("JAXDDP_COLLECTIVES") == "xla"
WHERE = ["jit", "eager", "spmd"]
BF16 = np.dtype(ml_dtypes.bfloat16)


def _tree(r, lead):
    """Rank ``r``'s tree, every leaf with a leading axis of ``lead``."""
    rng = np.random.default_rng(1000 + r)
    return {
        "f32": jnp.asarray(rng.standard_normal((lead, 3)), jnp.float32),
        "bf16": jnp.asarray(rng.standard_normal(lead), jnp.bfloat16),
        "i32": jnp.asarray(rng.integers(-50, 50, (lead, 2)), jnp.int32),
        "big": jnp.asarray(rng.integers(2**29, 2**30, lead), jnp.int32),  # a sum past int32
        "i8": jnp.asarray(rng.integers(90, 128, lead), jnp.int8),  # a sum past int8
        "flag": jnp.asarray(rng.random(lead) < 0.5),
    }


def _run(fn, tree, where):
    if where == "eager":
        return fn(tree)
    if where == "jit":
        return jax.jit(fn)(tree)
    return jaxddp.spmd(fn)(tree)


def _rank_order(op, key, lead, where):
    """This rank's block of every rank's leaf ``key``, reduced as jaxddp's dtype rules say,
    the blocks added in rank order; a float mean divided as the path divides (XLA's division
    by 3 is not NumPy's to the bit: it multiplies by the reciprocal)."""
    blocks = [np.asarray(_tree(r, lead)[key]).reshape(size, -1)[rank] for r in range(size)]
    dtype = blocks[0].dtype
    wide = {np.dtype(bool): np.int32, BF16: np.float32}.get(dtype, dtype)
    if op == "mean" and dtype.kind in "iub":
        wide = np.int64  # the exact sum, divided below
    total = blocks[0].astype(wide)
    for b in blocks[1:]:
        total = total + b.astype(wide)
    if op == "sum":
        return total if dtype == bool else total.astype(dtype)
    if dtype.kind in "iub":
        return (total / size).astype(np.float32)
    if where == "eager":
        return (total / size).astype(dtype)
    return np.asarray(jax.jit(lambda t: (t / size).astype(dtype))(total))


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_scatter_gives_each_rank_its_block_of_the_reduction(op, tiled, where):
    lead = 2 * size if tiled else size
    tree = _tree(rank, lead)
    out = _run(lambda t: jaxddp.reduce_scatter(t, op, tiled=tiled), tree, where)
    whole = _run(lambda t: jaxddp.allreduce(t, op=op), tree, where)
    for key, x in tree.items():
        block = (2, *x.shape[1:]) if tiled else x.shape[1:]
        got = out[key]
        assert isinstance(got, np.ndarray if where == "eager" else jax.Array), key
        assert got.shape == block, key
        assert got.dtype == whole[key].dtype, key  # allreduce's dtype rules
        want = _rank_order(op, key, lead, where)
        flat = np.asarray(got).reshape(-1)
        if x.dtype.kind in "iub":  # exact on every path; the same as allreduce's block
            np.testing.assert_array_equal(
                flat, np.asarray(whole[key]).reshape(size, -1)[rank], err_msg=key
            )
            if op == "sum":
                np.testing.assert_array_equal(flat, want, err_msg=key)
            else:  # jit's int32 mean is its exact sum rounded to float32, then divided
                np.testing.assert_allclose(flat, want, rtol=1e-6, err_msg=key)
        elif XLA and where == "spmd":  # XLA's own order of the sum
            tolerance = 1e-2 if x.dtype == jnp.bfloat16 else 1e-6
            np.testing.assert_allclose(
                flat.astype(np.float32), want.astype(np.float32), rtol=tolerance, atol=tolerance
            )
        else:  # through MPI: the rank-order sum, to the bit
            np.testing.assert_array_equal(flat.view(np.uint8), want.view(np.uint8), err_msg=key)


@pytest.mark.parametrize("where", WHERE)
def test_reduce_scatter_then_all_gather_is_an_allreduce(where):
    tree = {"i32": _tree(rank, 2 * size)["i32"], "f": jnp.full((size, 2), rank + 0.5, jnp.float32)}

    def zero_step(t):
        mine = jaxddp.reduce_scatter(t, "sum", tiled=True)
        return jaxddp.all_gather(mine, tiled=True), jaxddp.allreduce(t, op="sum")

    back, whole = _run(zero_step, tree, where)
    for key, x in tree.items():  # integers, and floats whose sums are exact in any order
        assert back[key].shape == x.shape
        np.testing.assert_array_equal(np.asarray(back[key]), np.asarray(whole[key]))


def _gathered_tree(r, empty=True):
    rng = np.random.default_rng(2000 + r)
    nan = np.array([0x7FC00000 + 17 + r], np.uint32).view(np.float32)  # a NaN with a payload
    return {
        "f32": jnp.asarray(np.concatenate([[-0.0], nan, rng.standard_normal(3)]), jnp.float32),
        "bf16": jnp.asarray(rng.standard_normal((2, 3)), jnp.bfloat16),
        "i8": jnp.asarray(rng.integers(-128, 128, 4), jnp.int8),
        "flag": jnp.asarray(rng.random(3) < 0.5),
        **({"empty": jnp.zeros((0, 2), jnp.float32)} if empty else {}),
    }


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype != bool else x


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather_gives_every_rank_every_ranks_bits_in_rank_order(tiled, where):
    # (jaxddp.spmd with xla gives back an empty result's whole global array, not its block)
    empty = not (XLA and where == "spmd")
    tree = _gathered_tree(rank, empty)
    out = _run(lambda t: jaxddp.all_gather(t, tiled=tiled), tree, where)
    everyone = [_gathered_tree(r, empty) for r in range(size)]
    for key, x in tree.items():
        parts = [np.asarray(t[key]) for t in everyone]
        want = np.concatenate(parts) if tiled else np.stack(parts)
        got = np.asarray(out[key])
        assert got.dtype == x.dtype, key
        assert got.shape == want.shape, key
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=key)


@pytest.mark.parametrize("where", ["jit", "eager"])
def test_all_gather_of_numbers_and_keys(where):
    tree = {"n": float(rank), "key": jax.random.key(rank)}
    out = _run(jaxddp.all_gather, tree, where)
    assert np.asarray(out["n"]).tolist() == [float(r) for r in range(size)]
    data = np.asarray(jax.random.key_data(out["key"]))
    want = np.stack([np.asarray(jax.random.key_data(jax.random.key(r))) for r in range(size)])
    np.testing.assert_array_equal(data, want)


BAD = {
    "an axis that does not divide": (
        lambda: jaxddp.reduce_scatter({"w": jnp.ones(2 * size + 1)}, tiled=True),
        ValueError,
        r"leading axis \(\d+\) does not divide into",
    ),
    "an axis that is not the world size": (
        lambda: jaxddp.reduce_scatter({"w": jnp.ones((size + 1, 2))}),
        ValueError,
        r"is not the world size",
    ),
    "a 0-d leaf": (
        lambda: jaxddp.reduce_scatter({"w": jnp.float32(1)}, tiled=True),
        ValueError,
        r"0-d leaf at `\['w'\]`",
    ),
    "a wrong op": (
        lambda: jaxddp.reduce_scatter({"w": jnp.ones(size)}, "max"),
        ValueError,
        r"to be 'sum' or 'mean', got 'max'",
    ),
    "a key": (
        lambda: jaxddp.reduce_scatter({"k": jax.random.split(jax.random.key(0), size)}),
        TypeError,
        r"cannot reduce the PRNG key",
    ),
    "a string": (
        lambda: jaxddp.all_gather({"w": jnp.ones(2), "name": "mlp"}),
        TypeError,
        r"`all_gather` got a str at `\['name'\]`",
    ),
    "a 0-d leaf, tiled": (
        lambda: jaxddp.all_gather({"w": jnp.float32(1)}, tiled=True),
        ValueError,
        r"pass `tiled=False`",
    ),
    "another op on rank 0": (
        lambda: jaxddp.reduce_scatter({"w": jnp.ones(size)}, "mean" if rank == 0 else "sum"),
        jaxddp.TreeMismatchError,
        r"`op` differs \(rank 0: 'mean', rank 1: 'sum'",
    ),
    "another shape on the last rank": (
        lambda: jaxddp.all_gather({"w": jnp.ones(3 if rank == size - 1 else 2)}),
        jaxddp.TreeMismatchError,
        rf"rank {size - 1} has float32\[3\]",
    ),
}


@pytest.mark.parametrize("where", ["eager", "jit"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_on_every_rank_and_the_ranks_go_on(case, where):
    call, error, match = BAD[case]
    run = call if where == "eager" else jax.jit(call)
    with pytest.raises(error, match=match):
        run()
    # nothing was sent: the next collective meets every rank's
    out = jaxddp.reduce_scatter({"w": jnp.full(size, 1.0)}, "sum")
    assert float(out["w"]) == size


def test_a_bad_input_inside_spmd_raises_on_every_rank():
    step = jaxddp.spmd(lambda x: jaxddp.reduce_scatter(x, tiled=True))
    with pytest.raises(ValueError, match="does not divide into"):
        step({"w": jnp.ones(2 * size + 1)})
    assert step({"w": jnp.ones(2 * size)})["w"].tolist() == [size, size]


def test_they_have_no_derivative_through_mpi():
    x = jnp.ones((size, 2))
    for collective in (jaxddp.reduce_scatter, jaxddp.all_gather):
        loss = jax.jit(jax.grad(lambda v, c=collective: jnp.sum(c(v))))
        with pytest.raises(NotImplementedError):
            loss(x)
