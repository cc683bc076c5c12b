"""The CUDA driver, as far as jaxddp needs it before and besides JAX; a leaf module.

jaxddp never links CUDA: where JAX has a CUDA plugin, it opens the driver's library
(``libcuda.so.1``, present wherever an NVIDIA driver is) with ctypes, to count and name the
GPUs a rank sees before JAX starts (:mod:`jaxddp._runtime.gpus`) and to hand the staged
collectives their entry points (:mod:`jaxddp._native.staged`). It imports nothing of jaxddp.

The test suite puts a stand-in library in the driver's place (:data:`stand_in`, which it sets
from a variable of its own, ``tests/harness/switches.py``; ``tests/native/driver.c``): the
same entry points, on host memory, with the GPUs it is told.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

__all__ = ["CudaError", "address", "devices", "driver", "jax_may_use_cuda", "stand_in"]

# The test suite's switch: the path of a stand-in for libcuda.so.1; None (always, for a user):
# the driver's own library.
stand_in: str | None = None
_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
            "jax_plugins.xla_cuda12")  # fmt: skip


class CudaError(RuntimeError):
    """A call of the CUDA driver failed, or the driver is not there."""


def jax_may_use_cuda() -> str | None:
    """The JAX CUDA plugin installed, where ``JAX_PLATFORMS`` lets JAX use it (else None);
    with the stand-in driver of the test suite, ``"stand-in"``."""
    if stand_in:
        return "stand-in"
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return None
    for name in _PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


@functools.cache
def driver() -> ctypes.CDLL:
    """The CUDA driver's library (CudaError where it cannot be opened), initialized."""
    path = stand_in or "libcuda.so.1"
    try:
        library = ctypes.CDLL(path)
    except OSError as error:
        msg = f"the CUDA driver's library ({path}) cannot be opened: {error}"
        raise CudaError(msg) from error
    _check(library, library.cuInit(0), "cuInit")
    return library


def _check(library: ctypes.CDLL, code: int, what: str) -> None:
    if code == 0:
        return
    name = ctypes.c_char_p()
    known = getattr(library, "cuGetErrorName", None)
    if known is not None and known(code, ctypes.byref(name)) == 0 and name.value:
        msg = f"{what} failed with CUDA error {code} ({name.value.decode()})"
    else:
        msg = f"{what} failed with CUDA error {code}"
    raise CudaError(msg)


def address(name: str) -> int:
    """The address of one of the driver's entry points (CudaError where it lacks it)."""
    library = driver()
    try:
        found = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    except AttributeError:
        found = None
    if not found:
        msg = f"the CUDA driver has no {name}"
        raise CudaError(msg)
    return found


def devices() -> list[str]:
    """The PCI bus ids of the GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applied), in
    the order CUDA numbers them (CudaError where the driver cannot tell)."""
    library = driver()
    count = ctypes.c_int(0)
    _check(library, library.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    found = []
    for ordinal in range(count.value):
        device = ctypes.c_int(0)
        _check(library, library.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        name = ctypes.create_string_buffer(64)
        code = library.cuDeviceGetPCIBusId(name, len(name), device)
        _check(library, code, "cuDeviceGetPCIBusId")
        found.append(name.value.decode())
    return found
