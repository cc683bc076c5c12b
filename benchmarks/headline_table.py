"""The README's headline table from a run of ``bench_headline.py`` (its ``--out`` JSON): no JAX
here, so tests/test_docs_claims.py can check the pages against the saved run."""

from __future__ import annotations

from typing import Any


def _ms(ms: float) -> str:
    return f"{ms:,.0f}" if abs(ms) >= 100 else f"{ms:.1f}" if abs(ms) >= 10 else f"{ms:.2f}"


def table(result: dict[str, Any]) -> str:
    """The README's table (Markdown) from a run's result: each step's median, and what sync
    adds to the same framework's step alone."""
    rows, jax_version, torch_version = result["rows"], result["jax"], result["torch"]
    lines = [
        "| per step, " + f"{result['ranks']} ranks | "
        + " | ".join(f"{r['leaves']} leaves, {r['bytes'] / 1e6:.2g} MB" for r in rows) + " |",
        "|---" * (len(rows) + 1) + "|",
    ]  # fmt: skip

    def line(label: str, key: str, alone: str | None = None) -> None:
        cells = []
        for r in rows:
            ms = r["step_s"][key] * 1e3
            cell = f"{_ms(ms)} ms"
            if alone:
                added = ms - r["step_s"][alone] * 1e3
                cell += f" ({'+' if added >= 0 else ''}{_ms(added)})"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    line(f"`jax.jit` + optax, no sync (jax {jax_version})", "jax_alone")
    line("the same + `jaxddp.allreduce_gradients()`", "jaxddp", "jax_alone")
    if torch_version:
        torch_name = f"PyTorch {torch_version.split('+')[0]}"
        line(f"{torch_name}, no sync", "torch_alone")
        line(f"{torch_name} `DistributedDataParallel` (gloo)", "torch_ddp", "torch_alone")
    line("JAX's own: one `jax.jit` over the ranks' mesh (gloo)", "jax_own", "jax_alone")
    return "\n".join(lines)
