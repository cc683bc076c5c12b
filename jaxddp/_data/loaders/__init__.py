"""The data loaders users already use, fed from :class:`jaxddp.DistributedSampler`.

Each module here imports its loader at the top and is imported only through its public
module (``jaxddp.grain``, ``jaxddp.torch``), which turns a missing loader into an
ImportError that names the package to install. The loaders know only the sampler: its
passes (:class:`jaxddp._data.sampler.BatchPass`) say which entries a rank reads, and the
sampler's position moves as the training loop takes each batch, not as a worker reads it.
"""

from __future__ import annotations

__all__ = ["missing"]


def missing(loader: str, extra: str, error: ImportError) -> ImportError:
    """The ImportError for a loader that is not installed, with the fix."""
    msg = (
        f"jaxddp.{extra} needs {loader}, which could not be imported ({error}). "
        f"Install it with `pip install {loader}` (the `{extra}` extra of jaxddp brings it: "
        "see jaxddp's docs page Installing)."
    )
    return ImportError(msg)
