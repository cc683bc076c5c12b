"""A jitted pytree allreduce across the ranks, printed from rank 0.

mpiexec -n 2 python -m jaxddp.examples.allreduce_demo
"""

import jax
import jax.numpy as jnp

import jaxddp


def main() -> None:
    rank, size = jaxddp.rank(), jaxddp.world_size()
    tree = {"weights": jnp.full((2, 3), rank + 1.0), "count": jnp.int32(rank + 1)}
    summed = jax.jit(lambda t: jaxddp.allreduce(t, op="sum"))(tree)
    expected = size * (size + 1) // 2
    if rank == 0:
        print(f"jaxddp {jaxddp.__version__}: {size} ranks")
        print(f"each rank r contributed r + 1; the jitted allreduce gave {summed['weights'][0, 0]}")
        print(f"and an int32 count of {int(summed['count'])} (expected {expected} for both)")
    ok = int(summed["count"]) == expected and bool(jnp.all(summed["weights"] == expected))
    if not ok:
        msg = f"rank {rank}: wrong result {summed}"
        raise SystemExit(msg)


if __name__ == "__main__":
    main()
