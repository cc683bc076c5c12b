"""W ranks with batch B train what one process trains with batch W*B: one JSON line per rank.

    mpiexec -n 2 python tests/gpu/exact.py [--precision highest|default]

A Flax NNX MLP with ``jaxddp.SyncBatchNorm``, 1000 samples (not a multiple of W*B, so the
last batches hold padding), ``DistributedSampler``, the loss as ``jaxddp.masked_mean``,
``optax.chain(jaxddp.allreduce_gradients(), optax.adam)``, 3 epochs. Every rank also trains
the one-process reference itself, through the same code on ``MPI.COMM_SELF`` with batch
W*B, and prints the largest difference of any parameter or batch statistic, and whether the
ranks' models are identical. Written for the GPU check (``tests/gpu/run.sh``); it runs on
any platform.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from mpi4py import MPI

import jaxddp

N, FEATURES, CLASSES, EPOCHS = 1000, 32, 5, 3


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, comm=None) -> None:
        # no bias before the norm: its gradient is 0 up to rounding, which adam turns into
        # steps of +-lr that differ between any two summation orders
        self.l1 = nnx.Linear(FEATURES, 256, use_bias=False, rngs=rngs)
        self.bn = jaxddp.SyncBatchNorm(256, comm=comm, rngs=rngs)
        self.l2 = nnx.Linear(256, CLASSES, rngs=rngs)

    def __call__(self, x, mask):
        return self.l2(jax.nn.relu(self.bn(self.l1(x), mask=mask[:, None])))


def train(batch: int, comm) -> nnx.State:
    data = np.random.default_rng(0)
    x = data.normal(size=(N, FEATURES)).astype(np.float32)
    y = data.integers(0, CLASSES, N)
    model = Model(nnx.Rngs(0), comm=comm)
    tx = optax.chain(jaxddp.allreduce_gradients(comm=comm), optax.adam(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y, mask):
        def loss_fn(model):
            logits = model(x, mask)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jaxddp.masked_mean(losses, mask, comm=comm)

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    sampler = jaxddp.DistributedSampler(N, seed=0, comm=comm)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for indices, mask in sampler.batches(batch):
            step(model, optimizer, jnp.asarray(x[indices]), jnp.asarray(y[indices]), mask)
    return nnx.state(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="highest", choices=["highest", "default"])
    parser.add_argument("--batch", type=int, default=16, help="per rank")
    args = parser.parse_args()
    if args.precision == "highest":
        jax.config.update("jax_default_matmul_precision", "highest")
    size = jaxddp.world_size()
    ours = jax.tree.map(np.asarray, train(args.batch, None))
    one = jax.tree.map(np.asarray, train(args.batch * size, MPI.COMM_SELF))
    pairs = zip(jax.tree.leaves(ours), jax.tree.leaves(one), strict=True)
    diff = max(float(np.max(np.abs(a - b))) for a, b in pairs)
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(ours):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    digest = digest.hexdigest()
    everyone = MPI.COMM_WORLD.allgather(digest)
    print(
        json.dumps(
            {
                "rank": jaxddp.rank(),
                "ranks": size,
                "platform": jax.default_backend(),
                "precision": args.precision,
                "max_abs_diff_to_one_process": diff,
                "identical_on_every_rank": len(set(everyone)) == 1,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
