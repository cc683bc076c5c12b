"""Settings for the whole suite, and the plugin that runs tests/mpi as real ranks."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.mpi_plugin import pytest_pycollect_makemodule, pytest_report_header

__all__ = ["pytest_pycollect_makemodule", "pytest_report_header"]
