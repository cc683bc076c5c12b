"""The train step the benchmarks time: a loss, its gradient, an optax update."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax


def optax_step(tx: Any, loss_fn: Callable) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` of ``tx`` on
    ``loss_fn(params, batch)``, not jitted (each benchmark wraps it its own way)."""

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
