"""Runs every example of docs/examples (the pages "Bring your own model and data" and
"Broadcast, reduce and the sharded optimizer") in this process, one after the other, and saves
each one's final parameters to ``OUT/<example>-rank<R>.npz``: one launch for all of them, on any
number of ranks.

    python tests/scripts/docs_examples.py OUT [EXAMPLE ...]
"""

import importlib
import sys
from pathlib import Path

import jax
import numpy as np

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
NAMES = [
    "nnx_model", "linen_train_state", "equinox_model", "grain_pipeline", "torch_dataloader",
    "collectives",
]  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or NAMES
    sys.path.insert(0, str(EXAMPLES))  # importable by name, also in spawned workers
    import jaxddp

    for name in names:
        params = importlib.import_module(name).main()
        leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(params)]
        np.savez(out / f"{name}-rank{jaxddp.rank()}.npz", *leaves)
        print(f"{name}: done, {len(leaves)} arrays", flush=True)


if __name__ == "__main__":
    main()
