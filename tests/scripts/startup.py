"""How a program's own mpi4py code meets ``import jaxddp``; values printed.

Usage: ``python startup.py SCENARIO...``: the scenarios in that order, in one process (the
first meets a fresh one; those that follow it only add to what it imported). Each prints
``key=value`` facts that the test (``tests/test_startup.py``) checks, with no launcher and
under ``mpiexec -n 2``.
"""

import sys

import jax.numpy as jnp  # jax touches no MPI: importing it first changes nothing here

for scenario in sys.argv[1:]:
    if scenario == "import-then-mpi4py":
        import jaxddp

        started_by = jaxddp.__name__  # jaxddp first, then the program's own mpi4py
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        total = world.allreduce(rank + 1)
        world.Barrier()
        print(f"initialized={MPI.Is_initialized()} multiple={multiple} rank={rank} size={size}")
        print(f"mpi4py allreduce={total} jaxddp rank={jaxddp.rank()} size={jaxddp.world_size()}")

    elif scenario == "mpi4py-first":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        total = world.allreduce(rank + 1)
        import jaxddp

        out = jaxddp.allreduce({"x": jnp.float32(rank + 1)}, op="sum")
        print(
            f"rank={rank} size={size} mpi4py allreduce={total} jaxddp allreduce={float(out['x']):g}"
        )

    elif scenario == "rc-initialize-false":
        import mpi4py

        mpi4py.rc.initialize = False
        import jaxddp

        assert jaxddp.__name__  # jaxddp first, then the program's own mpi4py
        from mpi4py import MPI

        print(f"after import: initialized={MPI.Is_initialized()}")
        out = jaxddp.allreduce({"x": jnp.float32(jaxddp.rank() + 1)}, op="sum")
        print(
            f"after first use: initialized={MPI.Is_initialized()} rank={jaxddp.rank()} "
            f"size={jaxddp.world_size()} jaxddp allreduce={float(out['x']):g}"
        )

    elif scenario == "mpi4py-bench":
        import runpy

        import jaxddp

        assert jaxddp.__name__
        sys.argv = ["mpi4py.bench", "helloworld"]
        runpy.run_module("mpi4py.bench", run_name="__main__")

    elif scenario == "mpi4jax-before":
        import mpi4jax
        from mpi4py import MPI

        import jaxddp

        comm = MPI.COMM_WORLD.Clone()
        mine = jnp.full(2, MPI.COMM_WORLD.Get_rank() + 1.0)
        theirs = mpi4jax.allreduce(mine, op=MPI.SUM, comm=comm)
        out = jaxddp.allreduce({"x": mine}, op="sum")
        print(
            f"rank={jaxddp.rank()} size={jaxddp.world_size()} "
            f"mpi4jax allreduce={theirs.tolist()} jaxddp allreduce={out['x'].tolist()}"
        )

    elif scenario == "mpi4jax-after":
        import jaxddp

        first = jaxddp.__name__  # jaxddp first, then the program's own mpi4jax
        import mpi4jax
        from mpi4py import MPI

        comm = MPI.COMM_WORLD.Clone()
        mine = jnp.full(2, jaxddp.rank() + 1.0)
        theirs = mpi4jax.allreduce(mine, op=MPI.SUM, comm=comm)
        out = jaxddp.allreduce({"x": mine}, op="sum")
        print(
            f"rank={jaxddp.rank()} size={jaxddp.world_size()} "
            f"mpi4jax allreduce={theirs.tolist()} jaxddp allreduce={out['x'].tolist()}"
        )

    elif scenario == "xla-late":  # JAX makes its devices, then jaxddp starts with xla
        import os

        import jax

        jax.devices()
        os.environ["JAXDDP_COLLECTIVES"] = "xla"
        try:
            import jaxddp
        except RuntimeError as error:
            print(f"refused: {error}")

    else:
        sys.exit(f"unknown scenario {scenario!r}")
