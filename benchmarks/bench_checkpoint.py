"""A checkpoint save with jaxddp.CheckpointManager against a single-process Orbax save, and
what a background save costs the caller and a training loop.

    mpiexec -n 2 python benchmarks/bench_checkpoint.py --out benchmarks/results/checkpoint-np2.json

The state: parameters and Adam's two moments of a model of 24 arrays (3 x 8 MB plus 21
small ones), about 92 MB, with a sampler state and a step counter. Everything below takes
turns in one launch, round after round (the order reversed every other round); medians.

``orbax``: rank 0 alone saves it with Orbax's own ``CheckpointManager`` (what a
single-process job does), the other ranks waiting in a barrier. ``jaxddp``: every rank calls
``jaxddp.CheckpointManager.save`` with ``background=False`` (rank 0 writes, the others learn
the outcome), until the checkpoint is complete on disk: "the write". Target: jaxddp at most
1.2x Orbax.
``background``: the time the manager's default ``save`` takes to return (every rank's host
copy; the comparison of the ranks' copies and the write go on behind it), waited for after
the timing. Target: at most 10% of ``jaxddp`` (``return_share``).
``checksums``: the CRC-32 of every array that the write computes (part of ``jaxddp``),
timed alone on rank 0. Target: at most 10% of the write.
``compare``: the comparison of the ranks' states that a blocking save makes in ``save``
(every rank's fingerprints and one small allgather), timed alone on every rank.
``fingerprints``: the fingerprints of one rank's host copy alone, what a background save's
thread computes on every rank before its allgather (and the writer before writing).
``loop``: a loop of ``--every`` jitted steps that update the state in place (donated), without
saves (``loop``) and with a background ``save`` at its first step (``loop+save``; the period
ends when its write has too). ``--step model`` (the default): the data-parallel train step of
the model whose state this is (:func:`make_model_step`: forward and backward of a batch of
32 per rank through its 24 matrices, the gradient averaged across the ranks, Adam's update
of the parameters and both moments), so the save's cost is measured against the steps it
interrupts. ``--step light``: the state's update alone and a scalar reduced across the ranks
(:func:`make_step`), a step ~10x cheaper than this model's, where the write's CPU (about
0.25 s, on the writing rank's core) weighs ten times as much. Target: ``loop+save`` at most 1.05x ``loop`` (``loop_ratio``: the median over rounds
of each round's ratio, the two periods of a round being neighbours in time).
``loop+unchecked save`` (``loop_ratio_unchecked``): the same with the ranks' comparison left
out on every rank (patched here, for this measure alone); ``check_share_of_loop``: the
median of each round's difference between the two, in loop periods without saves: what the
check costs the loop. ``--every 0`` leaves the loop out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxddp
from jaxddp._collectives import api as _comm
from jaxddp._training.checkpoint import background as _background
from jaxddp._training.checkpoint import replicated as _replicated
from jaxddp._training.checkpoint import trees as _checkpoint_trees


def make_state() -> dict:
    rng = np.random.default_rng(0)
    params = {f"layer{i}": jnp.asarray(rng.normal(size=(256, 256)), jnp.float32) for i in range(21)}
    params.update(
        {f"big{i}": jnp.asarray(rng.normal(size=(2048, 1024)), jnp.float32) for i in range(3)}
    )
    return {
        "params": params,
        "mu": {k: v * 0.1 for k, v in params.items()},
        "nu": {k: v * v for k, v in params.items()},
        "sampler": {"epoch": 3, "position": 1024, "data_size": 60000, "seed": 0,
                    "shuffle": True, "drop_last": False},
        "step": 1000,
    }  # fmt: skip


def make_step():
    """A training step's stand-in: every array of the state updated in place (donated, as an
    optimizer's update) and a scalar reduced across the ranks inside ``jax.jit`` (the ranks
    move in lockstep, as in data-parallel training)."""

    def step(state):
        arrays = {k: state[k] for k in ("params", "mu", "nu")}
        total = sum(jnp.sum(v[:1]) for v in jax.tree.leaves(arrays["params"]))
        lockstep = jaxddp.allreduce(total, op="mean") * 1e-9
        arrays = jax.tree.map(lambda v: v * 0.999 + lockstep, arrays)
        return {**state, **arrays, "step": state["step"] + 1}

    return jax.jit(step, donate_argnums=0)


def make_model_step(batch: int = 32):
    """The data-parallel train step of the state's model: a per-rank batch through the three
    2048x1024 matrices (side by side) and the chain of 21 256x256 ones, the gradient averaged
    across the ranks (``allreduce_gradients``, 31 MB), Adam's update of ``params``, ``mu`` and
    ``nu`` in place (donated)."""
    x = jax.random.normal(jax.random.key(jaxddp.rank()), (batch, 2048))
    sync = jaxddp.allreduce_gradients()

    def loss(params):
        total = sum(jnp.mean(jax.nn.relu(x @ params[f"big{i}"]) ** 2) for i in range(3))
        h = x[:, :256]
        for i in range(21):
            h = jnp.tanh(h @ params[f"layer{i}"] / 16)
        return total + jnp.mean(h**2)

    def step(state):
        grads, _ = sync.update(jax.grad(loss)(state["params"]), optax.EmptyState())
        mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["mu"], grads)
        nu = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, state["nu"], grads)
        params = jax.tree.map(
            lambda p, m, v: p - 1e-6 * m / (jnp.sqrt(v) + 1e-8), state["params"], mu, nu
        )
        return {**state, "params": params, "mu": mu, "nu": nu, "step": state["step"] + 1}

    return jax.jit(step, donate_argnums=0)


def report(result: dict, out: Path | None) -> None:
    """Prints ``result`` without its samples and writes it whole to ``out`` (JSON)."""
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


def main() -> None:
    import orbax.checkpoint as ocp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--every", type=int, default=300, help="loop steps between two saves")
    parser.add_argument(
        "--step", choices=("model", "light"), default="model", help="the loop's step (above)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    comm = _comm.py_comm()
    rank, size = comm.Get_rank(), comm.Get_size()
    state = make_state()
    root = comm.bcast(tempfile.mkdtemp(prefix="jaxddp-bench-ckpt-") if rank == 0 else None)
    ours = jaxddp.CheckpointManager(f"{root}/jaxddp", max_to_keep=2, background=False)
    behind = jaxddp.CheckpointManager(f"{root}/background", max_to_keep=2)
    looping = jaxddp.CheckpointManager(f"{root}/loop", max_to_keep=2)
    theirs = None
    if rank == 0:
        options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
        theirs = ocp.CheckpointManager(f"{root}/orbax", options=options)

    def orbax_save(step: int) -> None:
        if theirs is not None:
            theirs.save(step, args=ocp.args.StandardSave(state))
            theirs.wait_until_finished()
        comm.Barrier()

    storable = _checkpoint_trees.to_storable(state)
    copy = _background.host_copy(storable)
    fns = {
        "orbax": orbax_save,
        "jaxddp": lambda step: ours.save(step, state),
        "background": lambda step: behind.save(step, state),
        "checksums": lambda step: rank == 0 and _checkpoint_trees.checksums(state),
        "compare": lambda step: _replicated.same_on_every_rank(
            ours._comm, storable, step=step, doing="compare", copy=False
        ),
        "fingerprints": lambda step: _replicated._fingerprints(copy),
    }
    samples: dict[str, list[float]] = {name: [] for name in fns}
    loop_state = jax.tree.map(jnp.asarray, make_state())  # its own arrays: donated below
    train = make_model_step() if args.step == "model" else make_step()
    for _ in range(3):
        loop_state = train(loop_state)
    jax.block_until_ready(loop_state)
    loop_names = ("loop", "loop+save", "loop+unchecked save")
    loops: dict[str, list[float]] = {k: [] for k in loop_names} if args.every > 0 else {}
    compare = _replicated.compare
    saved = 0

    def period(name: str) -> float:
        """Seconds per step of one period of the loop, its save's write included."""
        nonlocal loop_state, saved
        # the unchecked save: the same, its ranks' comparison left out on every rank (no
        # fingerprints, no allgather), to tell what the check costs the loop
        unchecked = name == "loop+unchecked save"
        _replicated.compare = (lambda *a, **k: None) if unchecked else compare
        start = time.perf_counter()
        for i in range(args.every):
            if i == 0 and name != "loop":
                saved += 1
                looping.save(saved, loop_state)
            loop_state = train(loop_state)
        jax.block_until_ready(loop_state)
        if name != "loop":
            looping.wait_until_finished()
        took = (time.perf_counter() - start) / args.every
        _replicated.compare = compare
        return took

    for step in range(args.repeats + 1):  # the first round warms up
        names = [*fns, *loops]
        for name in names if step % 2 == 0 else names[::-1]:
            comm.Barrier()
            if name in loops:
                took = period(name)
            else:
                start = time.perf_counter()
                fns[name](step)
                if name != "background":
                    comm.Barrier()
                took = time.perf_counter() - start
                if name == "background":
                    behind.wait_until_finished()  # the write: after the timing
            if step > 0:
                (loops if name in loops else samples)[name].append(took)
    for manager in (ours, behind, looping):
        manager.close()
    if theirs is not None:
        theirs.close()
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: float(np.median(s)) for name, s in samples.items()}
    nbytes = sum(np.asarray(x).nbytes for x in (*state["params"].values(), *state["mu"].values(),
                                                *state["nu"].values()))  # fmt: skip
    # every rank's own return, slowest rank's median: the loop waits for the slowest
    returns = comm.allgather(medians["background"])
    result = {
        "ranks": size,
        "bytes": int(nbytes),
        "orbax_s": medians["orbax"],
        "jaxddp_s": medians["jaxddp"],
        "ratio": medians["jaxddp"] / medians["orbax"],
        "background_returns_s": max(returns),
        "background_returns_per_rank_s": returns,
        "return_share": max(returns) / medians["jaxddp"],
        "checksums_s": medians["checksums"],
        "checksums_share": medians["checksums"] / medians["jaxddp"],
        "compare_s": medians["compare"],
        "compare_share": medians["compare"] / medians["jaxddp"],
        "fingerprints_s": medians["fingerprints"],
        "fingerprints_share": medians["fingerprints"] / medians["jaxddp"],
    }
    if loops:
        step_s = {name: float(np.median(s)) for name, s in loops.items()}
        base = np.asarray(loops["loop"])
        saving, unchecked = np.asarray(loops["loop+save"]), np.asarray(loops["loop+unchecked save"])
        result.update(
            every=args.every,
            step=args.step,
            loop_step_s={
                "none": step_s["loop"],
                "background": step_s["loop+save"],
                "background_unchecked": step_s["loop+unchecked save"],
            },
            # each round's three periods ran one after the other: their ratios, paired by
            # round, cancel the load that other jobs put on the machine from round to round
            loop_ratio=float(np.median(saving / base)),
            loop_ratio_unchecked=float(np.median(unchecked / base)),
            check_share_of_loop=float(np.median((saving - unchecked) / base)),
            loop_ratio_of_medians=step_s["loop+save"] / step_s["loop"],
        )
    result["samples"] = {**samples, **loops}
    if rank == 0:
        report(result, args.out)


if __name__ == "__main__":
    main()
