"""Runnable examples: ``python -m jaxddp.examples.NAME`` (under ``mpiexec -n N`` for N ranks)."""
