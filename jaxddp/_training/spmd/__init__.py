"""``jaxddp.spmd``: a per-rank step, run with JAX's own collectives when ``JAXDDP_COLLECTIVES=xla``.

The user's step stays a per-rank function: its arguments are this rank's values (the model,
the optimizer state, this rank's batch), jaxddp's collectives inside it reduce across the
ranks, and it returns this rank's results. With ``JAXDDP_COLLECTIVES=mpi`` (the default)
:func:`spmd` is ``jax.jit`` (``nnx.jit`` for a step given Flax NNX objects). With ``xla``
(:mod:`.mapped`), the step runs under ``jax.shard_map`` over the ranks' mesh (one device per
rank, :func:`jaxddp._runtime.distributed.mesh`) with jaxddp's collectives bound to the mesh
axis (``psum``, ``all_gather``, ``all_to_all``: NCCL on GPUs, gloo on CPUs); what the step
computes alike on every rank stays a replicated global array between calls (:mod:`.form`),
and the ranks agree on each call's arguments first (:mod:`.agree`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ..._base import settings as _settings
from .mapped import Mapped
from .nnx_slots import split

__all__ = ["spmd"]


def spmd(fun: Callable[..., Any] | None = None, *, static_argnums: int | Sequence[int] = ()) -> Any:
    """Runs a per-rank training step with the collectives ``JAXDDP_COLLECTIVES`` picks.

    Write the step as for one rank (``jaxddp.masked_mean`` loss,
    ``optax.chain(jaxddp.allreduce_gradients(), ...)``, ``SyncBatchNorm``, a sharded
    optimizer) and wrap it once: ``step = jaxddp.spmd(train_step)``, or use it as a
    decorator. With ``mpi`` (the default) it is ``jax.jit``, or ``nnx.jit`` where its first
    call passes Flax NNX objects (a step already made with ``jax.jit`` or ``nnx.jit`` is
    returned as it is). With ``xla`` every rank runs the step over a one-axis mesh of the
    ranks' devices, and jaxddp's collectives in it are JAX's own (NCCL on GPUs); the
    results equal the MPI path's. See the XLA collectives page.

    Args:
      fun: the step: arrays, pytrees of arrays and Flax NNX objects in (NNX objects,
        wherever they stand among the arguments, are updated in place, and returned as
        themselves, as with ``nnx.jit``), a pytree of arrays out. It may be jitted.
      static_argnums: arguments that are not arrays (a flag, a size): hashable, part of
        what the step is compiled for.

    Returns:
      The wrapped step: called with this rank's values, it returns this rank's results
      (with ``xla``, what every rank computed alike is a global array every rank holds
      whole, which the next call takes as it is; read it as any array).
      Every rank must call it, with arguments of the same tree, shapes and dtypes;
      otherwise every rank raises :class:`jaxddp.TreeMismatchError` naming the first
      difference (``JAXDDP_CHECK=0`` turns that check off).

    Example:
      >>> import jax.numpy as jnp, jaxddp
      >>> step = jaxddp.spmd(lambda x: jaxddp.allreduce(x, op="sum"))
      >>> float(step(jnp.float32(1.0))) == jaxddp.world_size()
      True
    """
    if fun is None:
        return functools.partial(spmd, static_argnums=static_argnums)
    statics = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    if _settings.collectives() != "xla":
        return fun if hasattr(fun, "lower") else _Jitted(fun, statics)
    return Mapped(fun, statics)


class _Jitted:
    """The MPI path's step: ``jax.jit``, or ``nnx.jit`` where the first call passes Flax NNX
    objects (``jax.jit`` would update copies of them, and the model would never train)."""

    def __init__(self, fun: Callable[..., Any], statics: tuple[int, ...]) -> None:
        self.fun, self.statics = fun, statics
        functools.update_wrapper(self, fun)
        self._run: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._run is None:
            dynamic = [a for i, a in enumerate(args) if i not in self.statics]
            if split((dynamic, kwargs))[0]:
                from flax import nnx

                self._run = nnx.jit(self.fun, static_argnums=self.statics)
            else:
                self._run = jax.jit(self.fun, static_argnums=self.statics)
        return self._run(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return jax.jit(self.fun, static_argnums=self.statics).lower(*args, **kwargs)
