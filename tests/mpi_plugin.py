"""pytest plugin: every ``tests/mpi/test_*.py`` runs as real ranks under ``mpiexec``.

A plain ``pytest`` collects, for each such file and each world size it asks for
(``MPI_SIZES = (2, 4)`` at module level, the default), one item ``[np=N]`` for the launch
itself and one item per test function, ``test_name[np=N]``. The first item of a group
launches the whole file once: every rank runs pytest on it and writes its own JUnit XML.
A test passes only when every rank's own pytest says it passed; a skip counts only when
every rank skipped it. A hang is caught by the harness's watchdog and reported with every
rank's stack as "deadlock suspected".
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import RANK_RUN_VARIABLE, LaunchResult, launch

DEFAULT_SIZES = (2, 4)
SIZES_VARIABLE = "JAXDDP_TEST_NP"  # e.g. "2" or "2,4": restricts the world sizes run


@dataclass
class Outcome:
    status: str  # "passed", "failed", "skipped"
    message: str = ""


def _module_plan(path: Path) -> tuple[tuple[int, ...], list[str], dict[str, dict[str, str]]]:
    """World sizes, test names and environment variants of a module, read without
    importing it. ``MPI_VARIANTS = {"name": {"VARIABLE": "value"}}`` launches the module
    once more per variant, with those variables set."""
    tree = ast.parse(path.read_text(), filename=str(path))
    sizes: tuple[int, ...] = DEFAULT_SIZES
    names: list[str] = []
    variants: dict[str, dict[str, str]] = {"": {}}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MPI_SIZES" for t in node.targets
        ):
            sizes = tuple(ast.literal_eval(node.value))
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MPI_VARIANTS" for t in node.targets
        ):
            variants.update(ast.literal_eval(node.value))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names.extend(
                f"{node.name}::{f.name}"
                for f in node.body
                if isinstance(f, ast.FunctionDef) and f.name.startswith("test")
            )
    wanted = os.environ.get(SIZES_VARIABLE)
    if wanted:
        allowed = {int(s) for s in wanted.split(",")}
        sizes = tuple(s for s in sizes if s in allowed)
    return sizes, names, variants


def _read_junit(text: str) -> dict[str, Outcome]:
    """test id (``Class::name[param]`` or ``name[param]``) -> outcome, from one rank's XML."""
    outcomes: dict[str, Outcome] = {}
    for case in ET.fromstring(text).iter("testcase"):
        classname = case.get("classname", "")
        name = case.get("name", "")
        cls = classname.rsplit(".", 1)[-1]
        key = f"{cls}::{name}" if cls.startswith("Test") else name
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            outcomes[key] = Outcome("failed", (failure.text or failure.get("message", "")))
        elif skipped is not None:
            outcomes[key] = Outcome("skipped", skipped.get("message", ""))
        else:
            outcomes[key] = Outcome("passed")
    return outcomes


class MPIRun:
    """One launch of one test module at one world size; runs at most once."""

    def __init__(self, path: Path, np: int, env: dict[str, str] | None = None) -> None:
        self.path, self.np, self.env = path, np, env or {}
        self.result: LaunchResult | None = None
        self.outcomes: dict[str, dict[str, Outcome]] = {}  # rank -> test id -> outcome

    def run(self) -> LaunchResult:
        if self.result is None:
            directory = Path(tempfile.mkdtemp(prefix=f"jaxddp-{self.path.stem}-np{self.np}-"))
            self.result = launch(
                [
                    "-m",
                    "pytest",
                    str(self.path),
                    "-p",
                    "no:cacheprovider",
                    "-q",
                    f"--junitxml={directory}/rank-{{rank}}.xml",
                    "-o",
                    "junit_family=xunit2",
                    f"--rootdir={self.path.parents[2]}",
                ],
                self.np,
                directory=directory,
                cwd=self.path.parents[2],
                env={**os.environ, **self.env} if self.env else None,
            )
            for xml in sorted(directory.glob("rank-*.xml")):
                rank = xml.stem[len("rank-") :]
                self.outcomes[rank] = _read_junit(xml.read_text())
            shutil.rmtree(directory, ignore_errors=True)
        return self.result


class MPILaunchItem(pytest.Item):
    """The launch itself: it fails on a hang, a crash, or a rank that ran nothing."""

    def __init__(self, *, mpi_run: MPIRun, **kwargs) -> None:
        super().__init__(**kwargs)
        self.mpi_run = mpi_run

    def runtest(self) -> None:
        result = self.mpi_run.run()
        missing = self.mpi_run.np - len(self.mpi_run.outcomes)
        if result.timed_out or missing:
            raise MPIFailure(result.report())
        failures = any(
            o.status == "failed" for r in self.mpi_run.outcomes.values() for o in r.values()
        )
        if result.returncode != 0 and not failures:
            raise MPIFailure(result.report())
        names = {frozenset(r) for r in self.mpi_run.outcomes.values()}
        if len(names) != 1:
            raise MPIFailure("ranks ran different sets of tests:\n" + result.report())

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, MPIFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"{self.name} ({self.mpi_run.path.name})"


class MPITestItem(MPILaunchItem):
    """One test function, judged by every rank's own pytest result."""

    def __init__(self, *, test_id: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.test_id = test_id

    def runtest(self) -> None:
        result = self.mpi_run.run()
        per_rank: dict[str, list[tuple[str, Outcome]]] = {}
        for rank, outcomes in self.mpi_run.outcomes.items():
            per_rank[rank] = [
                (key, o)
                for key, o in outcomes.items()
                if key == self.test_id or key.startswith(self.test_id + "[")
            ]
        if len(per_rank) < self.mpi_run.np or not all(per_rank.values()):
            raise MPIFailure(
                f"{self.test_id}: no result from every rank "
                f"({len(per_rank)} of {self.mpi_run.np} ranks reported it)\n" + result.report()
            )
        failed = [
            f"----- rank {rank}: {key} -----\n{o.message}"
            for rank, cases in sorted(per_rank.items())
            for key, o in cases
            if o.status == "failed"
        ]
        if failed:
            raise MPIFailure("\n".join(failed))
        statuses: dict[str, set[str]] = {}
        for cases in per_rank.values():
            for key, o in cases:
                statuses.setdefault(key, set()).add(o.status)
        uneven = [key for key, s in statuses.items() if len(s) > 1]
        if uneven:
            raise MPIFailure(
                f"skipped on some ranks only (never do that with collectives): {uneven}"
            )
        if all(s == {"skipped"} for s in statuses.values()):
            reason = next(iter(per_rank.values()))[0][1].message
            pytest.skip(f"skipped on every rank: {reason}")


class MPIFailure(Exception):
    """A failure whose report is already complete text."""


class MPIModule(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        sizes, names, variants = _module_plan(self.path)
        for np in sizes:
            for variant, env in variants.items():
                mpi_run = MPIRun(self.path, np, env)
                tag = f"np={np}" + (f"-{variant}" if variant else "")
                yield MPILaunchItem.from_parent(self, name=f"[{tag}]", mpi_run=mpi_run)
                for name in names:
                    yield MPITestItem.from_parent(
                        self, name=f"{name}[{tag}]", mpi_run=mpi_run, test_id=name
                    )


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector):
    if os.environ.get(RANK_RUN_VARIABLE) or module_path.parent.name != "mpi":
        return None
    return MPIModule.from_parent(parent, path=module_path)


def pytest_report_header(config: pytest.Config) -> str:
    sizes = os.environ.get(SIZES_VARIABLE, ",".join(map(str, DEFAULT_SIZES)))
    return f"jaxddp MPI harness: tests/mpi/* run as real ranks, world sizes {sizes}"


# -- on the ranks: a failure on one rank must not become a silent hang ---------------------
#
# A test that fails on one rank leaves the others waiting in the next collective, and the
# launch ends as "deadlock suspected". Two things make that report useful and keep pytest's
# own rank-local, timing-dependent errors from causing it:
# - every failure is written to the rank's log the moment it happens, so the dump of a
#   hung launch shows what the rank that left was doing;
# - an exception in a thread or in a finalizer (pytest turns it into a warning, and
#   ``filterwarnings = error`` into an error of whichever test phase is running when it is
#   noticed, on that rank alone) is recorded instead, and written to the log at the end of
#   the session, where no collective waits for it. It fails the rank there when its
#   traceback passes through this repository's code; one raised entirely inside a
#   third-party package (a finalizer run by the garbage collector at a random moment) is
#   only written to the log.

_LATE_WARNINGS = ("PytestUnraisableExceptionWarning", "PytestUnhandledThreadExceptionWarning")
_late: list[str] = []


def _on_rank() -> bool:
    return bool(os.environ.get(RANK_RUN_VARIABLE))


def _through(text: str, root: Path) -> bool:
    """Whether a formatted traceback has a frame in ``root`` outside installed packages."""
    return any(
        line.lstrip().startswith(f'File "{root}') and "site-packages" not in line
        for line in text.splitlines()
    )


def pytest_configure(config: pytest.Config) -> None:
    if _on_rank():
        for name in _LATE_WARNINGS:
            config.addinivalue_line("filterwarnings", f"always::pytest.{name}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and _on_rank():
        sys.stderr.write(
            f"\njaxddp test harness: {report.nodeid} failed in {report.when} on this rank:\n"
            f"{report.longreprtext}\n"
        )
        sys.stderr.flush()


def pytest_warning_recorded(warning_message, when, nodeid, location) -> None:
    if type(warning_message.message).__name__ in _LATE_WARNINGS:
        _late.append(f"{nodeid or when}: {warning_message.message}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not (_late and _on_rank()):
        return
    sys.stderr.write(
        "\njaxddp test harness: exceptions in threads or finalizers on this rank (reported "
        "here, at the end, so that no other rank waits for this one):\n" + "\n".join(_late) + "\n"
    )
    sys.stderr.flush()
    if any(_through(text, session.config.rootpath) for text in _late):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
