"""What ``jaxddp doctor`` says about GPUs (jaxddp/_doctor_gpu.py) and the CUDA driver seen
through the stand-in of the test suite (jaxddp/_base/cuda.py); no launch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from jaxddp import _doctor_gpu
from jaxddp._base import cuda
from jaxddp._runtime import launcher
from tests.harness import stand_in_driver
from tests.harness.switches import DRIVER_VARIABLE, PRELUDE

A = "0000:01:00.0"


def _row(rank, **changes):
    row = _doctor_gpu.GpuFacts(
        rank=rank,
        jax_cuda="jax_cuda13_plugin",
        gpu=f"GPU 0 ({A}: the one GPU this rank sees)",
        bus=A,
        sharing=(rank,),
        preallocate="XLA_PYTHON_CLIENT_PREALLOCATE=false",
        fraction=None,
        libraries=("/v/lib/libmpi.so.12",),
        mpi4jax_cuda=True,
    )
    return dataclasses.replace(row, **changes)


def test_ranks_sharing_a_gpu_that_preallocate_too_much_are_a_problem_with_the_fix():
    rows = [_row(r, sharing=(0, 1), preallocate="default", fraction=0.75) for r in (0, 1)]
    (problem,) = [p for p in _doctor_gpu.problems(rows) if "share the GPU" in p]
    assert f"ranks 0, 1 share the GPU {A}" in problem
    assert "150%" in problem
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.45" in problem
    # as jaxddp leaves them (no preallocation), or with fractions that fit: no problem
    fine = [_row(r, sharing=(0, 1)) for r in (0, 1)]
    assert not [p for p in _doctor_gpu.problems(fine) if "share the GPU" in p]
    fit = [_row(r, sharing=(0, 1), fraction=0.45) for r in (0, 1)]
    assert not [p for p in _doctor_gpu.problems(fit) if "share the GPU" in p]


def test_two_mpi_libraries_in_one_process_name_both_and_the_build_that_fixes_it():
    libraries = ("/v/lib/libmpi.so.12", "/usr/lib/x86_64-linux-gnu/libmpi.so.40")
    (problem,) = _doctor_gpu.problems([_row(0, libraries=libraries)])
    assert all(path in problem for path in libraries)
    assert "LDFLAGS=" in problem
    assert "--no-build-isolation" in problem
    assert not _doctor_gpu.problems([_row(0)])


def test_the_mpi4jax_build_puts_the_loaded_mpis_folders_first():
    libmpi = launcher.loaded_libmpi()
    assert libmpi is not None  # this process loaded mpi4py's MPI (importing jaxddp)
    command = _doctor_gpu.mpi4jax_build_command()
    assert f"LDFLAGS='-L{libmpi.parent} -Wl,-rpath,{libmpi.parent}'" in command
    assert f"MPI4JAX_BUILD_MPICC={libmpi.parent.parent / 'bin' / 'mpicc'}" in command
    assert command.endswith("--force-reinstall --no-deps mpi4jax")


def test_the_stand_in_driver_shows_the_gpus_it_is_told():
    code = PRELUDE + "from jaxddp._base import cuda; print(cuda.devices(), cuda.jax_may_use_cuda())"
    env = {DRIVER_VARIABLE: str(stand_in_driver()), "JAXDDP_TEST_GPUS": f"{A},0000:41:00.0"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert out.stdout.split("\n")[0] == f"['{A}', '0000:41:00.0'] stand-in", out.stderr


@pytest.mark.parametrize(("platforms", "expected"), [("cpu", None), ("", None)])
def test_without_a_cuda_plugin_jax_uses_no_gpu(monkeypatch, platforms, expected):
    # this machine's JAX has no CUDA plugin; JAX_PLATFORMS=cpu rules one out anyway
    monkeypatch.setattr(cuda, "stand_in", None)
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert cuda.jax_may_use_cuda() is expected
