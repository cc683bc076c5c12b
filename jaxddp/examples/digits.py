"""Data-parallel training of a Flax NNX classifier on scikit-learn's digits data set.

    mpiexec -n 2 python -m jaxddp.examples.digits           # 2 ranks, global batch 64
    python -m jaxddp.examples.digits --batch-size 64         # 1 rank, the same global batch
    mpiexec -n 2 python -m jaxddp.examples.digits --checkpoint-dir ckpt   # saved every epoch
    mpiexec -n 4 python -m jaxddp.examples.digits --checkpoint-dir ckpt --batch-size 16 --resume

The digits (1,797 images of 8x8 pixels) ship with scikit-learn: nothing is downloaded. Every
rank loads the whole data set and trains on its own shard of every epoch, chosen by
`jaxddp.DistributedSampler`. The loss is `jaxddp.masked_mean` of the per-sample losses, the
exact mean over the real samples of all ranks, and `jaxddp.allreduce_gradients()` averages
the gradients inside the optimizer, so every step is one process's step on the global batch.
`jaxddp.SyncBatchNorm` normalizes with the statistics of the global batch, so the model is
the one a single process trains, on every rank, also at world and batch sizes where some
rank's last batch is only padding (1,347 samples at 4 ranks x 16). Rank 0 alone
shows progress; at the end every rank evaluates its shard of the test set, `masked_mean`
combines them exactly, and the run checks that all ranks hold an identical model, parameters
and batch statistics (exit status 1 if not). With `--checkpoint-dir` every epoch is saved
with `jaxddp.CheckpointManager`, and `--resume` continues from the newest checkpoint, on any
number of ranks; the run ends with a digest of its final parameters, so that a resumed run
can be compared with an uninterrupted one.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.typing import ArrayLike
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import jaxddp

DESCRIPTION = "Data-parallel training of a Flax NNX classifier on the digits data set."


class MLP(nnx.Module):
    """64 pixels -> 128 hidden units (batch-normalized over the global batch) -> 10 classes."""

    def __init__(self, rngs: nnx.Rngs, hidden: int = 128) -> None:
        # No bias before the norm: the norm subtracts it again, so its gradient is zero up
        # to rounding, which Adam would turn into steps of +-lr.
        self.hidden = nnx.Linear(64, hidden, use_bias=False, rngs=rngs)
        # The statistics of every rank's real samples (one small allreduce per step); the
        # two-pass variance stays accurate on a last batch of few samples.
        self.norm = jaxddp.SyncBatchNorm(hidden, use_fast_variance=False, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: ArrayLike, mask: jax.Array | None = None) -> jax.Array:
        # The mask keeps the padding out of the batch statistics.
        hidden = self.norm(self.hidden(jnp.asarray(x)), mask=mask)
        return self.out(jax.nn.relu(hidden))


def load_digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The same train/test split on every rank: 1,347 training and 450 test images."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    x, y = sklearn_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    return np.asarray(x_train), np.asarray(y_train), np.asarray(x_test), np.asarray(y_test)


@jaxddp.spmd  # JAXDDP_COLLECTIVES=xla: over the ranks' mesh, JAX's own collectives
@nnx.jit
def train_step(
    model: MLP, optimizer: nnx.Optimizer, x: ArrayLike, y: ArrayLike, mask: ArrayLike
) -> jax.Array:
    """One step on the global batch; returns its loss, the mean over the real samples of
    all ranks."""

    def loss_fn(model: MLP) -> jax.Array:
        per_example = optax.softmax_cross_entropy_with_integer_labels(
            model(x, jnp.asarray(mask)), y
        )
        # The exact mean over every rank's real samples (padding, mask False, left out):
        # its gradient, averaged by allreduce_gradients, is one process's gradient.
        return jaxddp.masked_mean(per_example, mask)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # allreduce_gradients runs first in the chain
    # SyncBatchNorm's running statistics are the global batch's: the same on every rank.
    return loss


@nnx.jit
def correct(model: MLP, x: ArrayLike, y: ArrayLike) -> jax.Array:
    return jnp.argmax(model(x), axis=-1) == y


def evaluate(model: MLP, x_test: np.ndarray, y_test: np.ndarray, batch_size: int) -> float:
    """Test accuracy over all ranks' shards; the padding duplicates are masked out."""
    sampler = jaxddp.DistributedSampler(len(x_test), shuffle=False)
    hits, masks = [], []
    for indices, mask in sampler.batches(batch_size):
        hits.append(correct(model, x_test[indices], y_test[indices]))
        masks.append(mask)
    return float(jaxddp.masked_mean(jnp.concatenate(hits), np.concatenate(masks)))


def identical_on_all_ranks(tree: Any) -> bool:
    """Whether every rank holds bitwise the same values: the max over ranks equals the min."""
    flat = jnp.concatenate([jnp.ravel(leaf) for leaf in jax.tree.leaves(tree)])
    high, low = jaxddp.allreduce(flat, op="max"), jaxddp.allreduce(flat, op="min")
    return bool(jnp.all(high == low))


def digest(tree: Any) -> str:
    """A short fingerprint of the values: equal digests, bitwise equal parameters."""
    sha = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        sha.update(np.asarray(leaf).tobytes())
    return sha.hexdigest()[:16]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="samples per rank and step; the global batch is this times the number of ranks",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument(
        "--compression",
        default="none",
        help="how gradients travel: none (exact), bf16, fp16, or powersgd-R (PowerSGD of rank R)",
    )
    parser.add_argument(
        "--powersgd-warmup",
        type=int,
        default=4,
        help="epochs of exact (full-width) steps before PowerSGD starts, as PyTorch's "
        "start_powerSGD_iter: the low-rank factors follow a gradient that has settled",
    )
    parser.add_argument("--seed", type=int, default=0, help="data split, shuffling and init")
    parser.add_argument(
        "--checkpoint-dir", default=None, help="save the training state there after every epoch"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir (on any number of ranks)",
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.powersgd_warmup < 0:
        parser.error("--powersgd-warmup must be 0 or more")
    if args.compression.startswith("powersgd-") and args.powersgd_warmup >= args.epochs:
        parser.error(
            f"--powersgd-warmup {args.powersgd_warmup} is not less than --epochs {args.epochs}: "
            "PowerSGD would never start; lower --powersgd-warmup (0 starts it at once)"
        )
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = jaxddp.world_size()
    console = Console(quiet=jaxddp.rank() != 0, soft_wrap=True)  # rank 0 speaks for everyone
    model, accuracy, test_images = train(args, console)
    same = identical_on_all_ranks(nnx.state(model))  # parameters and batch statistics
    console.print(f"test accuracy: {accuracy:.2%} ({test_images} test images)")
    console.print(f"model identical on all {size} ranks: {'yes' if same else 'NO'}")
    console.print(f"final parameters: digest {digest(nnx.state(model, nnx.Param))}")
    return 0 if same else 1


def train(args: argparse.Namespace, console: Console) -> tuple[MLP, float, int]:
    """Trains as ``args`` say (resuming and checkpointing if asked); the trained model, its
    test accuracy and the number of test images."""
    rank, size = jaxddp.rank(), jaxddp.world_size()
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    console.print(
        f"jaxddp {jaxddp.__version__}: digits on {size} rank{'s' * (size > 1)}, "
        f"{len(x_train)} training / {len(x_test)} test images, "
        f"batch {args.batch_size} per rank = {args.batch_size * size} global"
    )

    # Each rank draws different initial parameters here (on purpose: seed + rank);
    # synchronize gives all of them rank 0's, so that they train one model.
    model = MLP(nnx.Rngs(args.seed + rank))
    nnx.update(model, jaxddp.synchronize(nnx.state(model, nnx.Param)))
    sampler = jaxddp.DistributedSampler(len(x_train), shuffle=True, seed=args.seed)
    steps = sampler.num_batches(args.batch_size)
    sync = compression(args.compression, warmup_steps=args.powersgd_warmup * steps)
    tx = optax.chain(jaxddp.allreduce_gradients(compression=sync), optax.adam(args.lr))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    checkpoints, first_epoch = None, 0
    if args.checkpoint_dir is not None:
        checkpoints = jaxddp.CheckpointManager(args.checkpoint_dir, max_to_keep=2)
        if args.resume and checkpoints.latest_step() is not None:
            state = checkpoints.restore(None, target=training_state(model, optimizer, sampler))
            nnx.update(model, state["model"])
            nnx.update(optimizer, state["optimizer"])
            sampler.load_state_dict(state["sampler"])
            first_epoch = sampler.epoch + 1  # checkpoints are taken at the end of an epoch
            console.print(f"resumed after epoch {first_epoch} from {args.checkpoint_dir}")
    global_batch = args.batch_size * size
    columns = (
        TextColumn("epoch {task.fields[epoch]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[rate]:,.0f} samples/s"),
        TimeElapsedColumn(),
    )
    start = time.perf_counter()
    with Progress(*columns, console=console, disable=rank != 0) as progress:
        total, done = args.epochs * steps, first_epoch * steps
        task = progress.add_task("train", total=total, completed=done, epoch=1, loss=0.0, rate=0.0)
        for epoch in range(first_epoch, args.epochs):
            sampler.set_epoch(epoch)
            epoch_start, losses = time.perf_counter(), []
            for indices, mask in sampler.batches(args.batch_size):
                loss = float(train_step(model, optimizer, x_train[indices], y_train[indices], mask))
                losses.append(loss)
                rate = len(losses) * global_batch / (time.perf_counter() - epoch_start)
                progress.update(task, advance=1, epoch=epoch + 1, loss=loss, rate=rate)
            seconds = time.perf_counter() - epoch_start
            progress.console.print(
                f"epoch {epoch + 1}/{args.epochs}: mean loss {np.mean(losses):.4f}, "
                f"{steps * global_batch / seconds:,.0f} samples/s"
            )
            if checkpoints is not None:
                checkpoints.save(epoch + 1, training_state(model, optimizer, sampler))
    elapsed = time.perf_counter() - start

    model.eval()  # batch norm now uses its running statistics
    accuracy = evaluate(model, x_test, y_test, batch_size=64)
    trained = args.epochs - first_epoch  # a resumed run trains the epochs after its checkpoint
    console.print(f"training: {elapsed:.1f} s for {trained} epochs of {steps} steps")
    if checkpoints is not None:
        checkpoints.close()
    return model, accuracy, len(x_test)


def compression(name: str, warmup_steps: int = 0) -> str | jaxddp.PowerSGD | None:
    """``--compression``'s value as ``allreduce_gradients`` takes it; PowerSGD starts after
    ``warmup_steps`` exact steps."""
    if name == "none":
        return None
    if name.startswith("powersgd-"):
        return jaxddp.PowerSGD(rank=int(name.removeprefix("powersgd-")), start_step=warmup_steps)
    return name


def training_state(
    model: MLP, optimizer: nnx.Optimizer, sampler: jaxddp.DistributedSampler
) -> dict[str, Any]:
    """Everything a resumed run needs: the model (parameters and batch statistics), the
    optimizer's state and where the sampler is."""
    return {
        "model": nnx.state(model),
        "optimizer": nnx.state(optimizer),
        "sampler": sampler.state_dict(),
    }


if __name__ == "__main__":
    raise SystemExit(main())
