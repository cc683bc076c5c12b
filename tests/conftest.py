"""Settings for the whole suite, and the plugin that runs tests/mpi as real ranks."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.mpi_plugin import (
    pytest_configure,
    pytest_pycollect_makemodule,
    pytest_report_header,
    pytest_runtest_logfinish,
    pytest_runtest_logreport,
    pytest_runtest_logstart,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_warning_recorded,
)

# Scripts that tests launch on real ranks, and recorded data: never collected (with
# --doctest-modules pytest would import the scripts, and they run at import).
collect_ignore = ["scripts", "data"]

__all__ = [
    "pytest_configure",
    "pytest_pycollect_makemodule",
    "pytest_report_header",
    "pytest_runtest_logfinish",
    "pytest_runtest_logreport",
    "pytest_runtest_logstart",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
    "pytest_warning_recorded",
]
