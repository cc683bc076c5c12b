"""Gradient-shaped payloads for the benchmarks: the leaf shapes of real models."""

from __future__ import annotations

import numpy as np


def resnet50_shapes(width: float = 1.0) -> list[tuple[int, ...]]:
    """Parameter shapes of ResNet-50 (conv kernels HWIO, batch-norm scale and bias, the
    classifier), with every channel count multiplied by ``width`` (at least 1)."""

    def c(n: int) -> int:
        return max(1, round(n * width))

    shapes: list[tuple[int, ...]] = [(7, 7, 3, c(64)), (c(64),), (c(64),)]
    in_ch = c(64)
    for blocks, mid in ((3, 64), (4, 128), (6, 256), (3, 512)):
        out = c(mid * 4)
        for b in range(blocks):
            shapes += [(1, 1, in_ch, c(mid)), (c(mid),), (c(mid),)]
            shapes += [(3, 3, c(mid), c(mid)), (c(mid),), (c(mid),)]
            shapes += [(1, 1, c(mid), out), (out,), (out,)]
            if b == 0:
                shapes += [(1, 1, in_ch, out), (out,), (out,)]
            in_ch = out
    shapes += [(in_ch, c(1000) if width >= 1 else 1000), (1000,)]
    return shapes


PAYLOADS = {
    # name: list of leaf shapes (float32)
    "4KB x1": [(1024,)],
    "ResNet-50 x0.1": resnet50_shapes(0.1),
    # the same parameters raveled into one vector (docs: sharp bits, many parameter arrays)
    "ResNet-50 x0.1 raveled": [(sum(int(np.prod(s)) for s in resnet50_shapes(0.1)),)],
    "1000 x 1KB": [(256,)] * 1000,
    "ResNet-50": resnet50_shapes(1.0),
}


def make_tree(shapes: list[tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"p{i:04d}": rng.standard_normal(s, dtype=np.float32) for i, s in enumerate(shapes)}


def nbytes(shapes: list[tuple[int, ...]]) -> int:
    return int(sum(np.prod(s) for s in shapes) * 4)
