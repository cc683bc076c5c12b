"""pytest plugin: every ``tests/mpi/test_*.py`` runs as real ranks under ``mpiexec``.

A plain ``pytest`` collects, for each such file and each world size it asks for
(``MPI_SIZES = (2, 4)`` at module level, the default), one item ``[np=N]`` for the launch
itself and one item per test function, ``test_name[np=N]``. The modules that share a world
size (and an environment variant, and a ``MPI_GROUP``) share one launch, made by the first
of their items to run: every rank runs pytest on all of them and writes its own JUnit XML,
and logs a line as each test starts and ends. A test passes only when every rank's own
pytest says it passed; a skip counts only when every rank skipped it. A hang is caught by the
harness's watchdog (no rank's log grew for ``JAXDDP_TEST_TIMEOUT`` seconds, 120 by default,
counted from the ranks' first line: their start may take ``START_LIMIT`` seconds) and
reported with every rank's stack as "deadlock suspected", naming the test each rank was in;
the modules of the launch that had finished on every rank before it keep their results.

``MPI_VARIANTS = {"name": {"VARIABLE": "value"}}`` launches the module once more per variant,
with those variables set, at every world size it runs at, or at those that
``MPI_VARIANT_SIZES = {"name": (2,)}`` names for it (``MPI_VARIANTS_ONLY = True``: in its
variants only, for a module that tests what a variant sets up). A value
``tests.harness.STAND_IN_DRIVER`` stands for the compiled stand-in of the CUDA driver.

``MPI_GROUP = "name"`` at module level gives a module (with the others of that name) a
launch of its own: for tests that hold gigabytes per rank.

``MPI_HOSTS = "n0:2,n1:2"`` launches a module's ranks as on that many nodes: MPICH's hydra
with its fork launcher starts every rank on this machine, but gives each "host" its own
shared-memory node (``MPI_Comm_split_type(SHARED)``) and joins them over TCP, so the code
for jobs that span nodes runs here too. Such a launch is a launch of its own (``slow``).

Every launch is a quick one (``tests.harness.launch(quick=True)``: MPICH's waits sleep, XLA
skips LLVM's optimizations); ``MPI_OPTIMIZED = True`` keeps LLVM's optimizations for the
launch of a module whose programs run long (the large leaves' reductions of GiB).

The items of the main launch at 2 ranks are the fast lane's (``pytest -m "not slow"``); those
of every other launch (3 or 4 ranks, a variant, a group) are marked ``slow``.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shutil
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import (
    RANK_RUN_VARIABLE,
    LaunchResult,
    default_timeout,
    launch,
    with_stand_in,
)

DEFAULT_SIZES = (2, 4)
# The launch the fast lane (``-m "not slow"``) keeps: 2 ranks, no variant, no MPI_GROUP.
# Every other launch's items carry the ``slow`` marker.
FAST_SIZE = 2
START_LIMIT = 120.0  # seconds a launch's ranks may take to write their first line
SIZES_VARIABLE = "JAXDDP_TEST_NP"  # e.g. "2" or "2,4": restricts the world sizes run
# What each rank writes to its log as a test starts and ends (see pytest_runtest_logstart).
_STARTS, _ENDS = "jaxddp test harness: start ", "jaxddp test harness: end "
_LATE = "jaxddp test harness: failed late: "  # see pytest_sessionfinish
_LATE_LINE = re.compile(f"^{_LATE}(.+)$", re.MULTILINE)
_LINE = re.compile(
    r"^jaxddp test harness: (?:start (?P<start>.+)|end (?P<end>.+) (?P<status>\w+) "
    r"(?P<seconds>[\d.]+) s)$",
    re.MULTILINE,
)


@dataclass
class Outcome:
    status: str  # "passed", "failed", "skipped"
    message: str = ""
    seconds: float = 0.0  # on the rank, from its start to its end (from the rank's log)


@dataclass
class Plan:
    sizes: tuple[int, ...]
    names: list[str]
    variants: dict[str, dict[str, str]]
    group: str = ""
    variant_sizes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    variants_only: bool = False
    optimized: bool = False
    hosts: str = ""  # MPI_HOSTS: simulated nodes, as hydra's -hosts takes them


def _module_plan(path: Path) -> Plan:
    """World sizes, test names, environment variants and launch group of a module, read
    without importing it. ``MPI_VARIANTS = {"name": {"VARIABLE": "value"}}`` launches the
    module once more per variant, with those variables set."""
    tree = ast.parse(path.read_text(), filename=str(path))
    plan = Plan(DEFAULT_SIZES, [], {"": {}})

    def assigns(node: ast.stmt, name: str) -> bool:
        return isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        )

    for node in tree.body:
        if assigns(node, "MPI_SIZES"):
            plan.sizes = tuple(ast.literal_eval(node.value))  # type: ignore[attr-defined]
        elif assigns(node, "MPI_VARIANTS"):
            plan.variants.update(ast.literal_eval(node.value))  # type: ignore[attr-defined]
        elif assigns(node, "MPI_VARIANTS_ONLY"):
            plan.variants_only = bool(ast.literal_eval(node.value))  # type: ignore[attr-defined]
        elif assigns(node, "MPI_VARIANT_SIZES"):
            sizes = ast.literal_eval(node.value)  # type: ignore[attr-defined]
            plan.variant_sizes = {k: tuple(v) for k, v in sizes.items()}
        elif assigns(node, "MPI_GROUP"):
            plan.group = str(ast.literal_eval(node.value))  # type: ignore[attr-defined]
        elif assigns(node, "MPI_OPTIMIZED"):
            plan.optimized = bool(ast.literal_eval(node.value))  # type: ignore[attr-defined]
        elif assigns(node, "MPI_HOSTS"):
            plan.hosts = str(ast.literal_eval(node.value))  # type: ignore[attr-defined]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            plan.names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            plan.names.extend(
                f"{node.name}::{f.name}"
                for f in node.body
                if isinstance(f, ast.FunctionDef) and f.name.startswith("test")
            )
    wanted = os.environ.get(SIZES_VARIABLE)
    if wanted:
        allowed = {int(s) for s in wanted.split(",")}
        plan.sizes = tuple(s for s in plan.sizes if s in allowed)
    return plan


def _test_key(nodeid: str) -> tuple[str, str]:
    """(module file name, test id as ``Class::name[param]`` or ``name[param]``)."""
    path, _, test = nodeid.partition("::")
    return Path(path).name, test


def _read_junit(text: str) -> dict[tuple[str, str], Outcome]:
    """(module file name, test id) -> outcome, from one rank's XML."""
    outcomes: dict[tuple[str, str], Outcome] = {}
    for case in ET.fromstring(text).iter("testcase"):
        parts = case.get("classname", "").split(".")
        name = case.get("name", "")
        if parts[-1].startswith("Test"):
            key = (f"{parts[-2]}.py", f"{parts[-1]}::{name}")
        else:
            key = (f"{parts[-1]}.py", name)
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


def _read_log(text: str) -> tuple[dict[tuple[str, str], Outcome], tuple[str, str] | None]:
    """From a rank's log (for a rank killed before it wrote its XML): the outcome of every
    test it finished, with what the rank wrote during a failed one, and the test it was in
    when it stopped, if any."""
    outcomes: dict[tuple[str, str], Outcome] = {}
    current, began = None, 0
    for line in _LINE.finditer(text):
        if line["start"]:
            current, began = _test_key(line["start"]), line.end()
        else:
            status = line["status"]
            note = text[began : line.start()].strip() if status == "failed" else ""
            outcomes[_test_key(line["end"])] = Outcome(
                status, f"(from the rank's log)\n{note}", float(line["seconds"])
            )
            current = None
    return outcomes, current


class MPIRun:
    """One launch, at one world size and environment, of every module that shares it;
    runs at most once."""

    def __init__(
        self, np: int, env: dict[str, str], rootdir: Path, name: str, hosts: str = ""
    ) -> None:
        self.np, self.env, self.rootdir = np, env, rootdir
        self.hosts = hosts  # MPI_HOSTS: the ranks on simulated nodes
        self.name = name  # e.g. "mpi np=4-ordered"
        self.paths: list[Path] = []  # every module collected into this launch
        self.ran: list[Path] = []  # the modules it launched
        self.result: LaunchResult | None = None
        self.outcomes: dict[str, dict[tuple[str, str], Outcome]] = {}  # rank -> key -> outcome
        self.stopped_in: dict[str, tuple[str, str]] = {}  # rank -> test it was in at the end
        self.late: set[str] = set()  # modules blamed for a late exception (see _LATE)

    def run(self, session: pytest.Session) -> LaunchResult:
        if self.result is None:
            # Only the modules that still have a selected item (-k, -m, node ids).
            selected = {
                item.path for item in session.items if getattr(item, "mpi_run", None) is self
            }
            self.ran = [p for p in self.paths if p in selected] or list(self.paths)
            tag = "-".join(p.stem.removeprefix("test_") for p in self.ran)[:60]
            directory = Path(tempfile.mkdtemp(prefix=f"jaxddp-np{self.np}-{tag}-"))
            # A hang is caught by ``quiet`` (no rank's log grew for that long: every test
            # writes a line as it starts and ends); ``timeout`` is only the backstop, for a
            # rank that keeps writing while the others hang: one limit per test.
            per_test = default_timeout()
            plans = [_module_plan(p) for p in self.ran]
            tests = sum(len(plan.names) for plan in plans)
            self.result = launch(
                [
                    "-m",
                    "pytest",
                    *map(str, self.ran),
                    "-p",
                    "no:cacheprovider",
                    "-q",
                    f"--junitxml={directory}/rank-{{rank}}.xml",
                    "-o",
                    "junit_family=xunit2",
                    f"--rootdir={self.rootdir}",
                ],
                self.np,
                directory=directory,
                cwd=self.rootdir,
                env={**os.environ, **with_stand_in(self.env)} if self.env else None,
                timeout=per_test * max(tests, 1),
                quiet=per_test,
                # the ranks' start (pytest, JAX, jaxddp, collection) is not a hang: 20-40 s
                # on a loaded machine (docs/testing.md), more than a short test limit
                start=max(per_test, START_LIMIT),
                # no test here tests the stall inspector (test_stall.py does): waits that
                # sleep and unoptimized code halve a launch on 2 cores (docs/testing.md)
                quick=True,
                optimized=any(plan.optimized for plan in plans),
                launcher_args=("-launcher", "fork", "-hosts", self.hosts) if self.hosts else (),
            )
            for log in sorted(directory.glob("rank-*.log")):
                rank = log.stem[len("rank-") :]
                text = log.read_text(errors="replace")
                outcomes, current = _read_log(text)
                self.late.update(_test_key(where)[0] for where in _LATE_LINE.findall(text))
                xml = log.with_suffix(".xml")
                if xml.exists():
                    for key, outcome in _read_junit(xml.read_text()).items():
                        if key in outcomes:
                            outcome.seconds = outcomes[key].seconds
                        outcomes[key] = outcome
                if outcomes or xml.exists():
                    self.outcomes[rank] = outcomes
                if current is not None:
                    self.stopped_in[rank] = current
            shutil.rmtree(directory, ignore_errors=True)
        return self.result

    def module_outcomes(self, module: str) -> dict[str, dict[str, Outcome]]:
        """rank -> test id -> outcome, for the tests of one module."""
        return {
            rank: {test: o for (m, test), o in outcomes.items() if m == module}
            for rank, outcomes in self.outcomes.items()
        }

    def stopped_in_text(self) -> str:
        if not self.stopped_in:
            return ""
        where = ", ".join(f"rank {r} in {m}::{t}" for r, (m, t) in sorted(self.stopped_in.items()))
        return f"the launch stopped with {where}\n"


class MPILaunchItem(pytest.Item):
    """The launch, as seen by one module: it fails on a hang or crash inside this module or
    before its tests all ran, on an exception in a thread or finalizer during one of its
    tests, on a failed launch that no test can be blamed for, or when the ranks ran
    different sets of its tests."""

    def __init__(self, *, mpi_run: MPIRun, names: list[str], **kwargs) -> None:
        super().__init__(**kwargs)
        self.mpi_run = mpi_run
        self.names = names

    def runtest(self) -> None:
        run = self.mpi_run
        result = run.run(self.session)
        module = self.path.name
        mine = run.module_outcomes(module)
        slowest: dict[str, float] = {}  # test -> the slowest rank's seconds
        for outcomes in mine.values():
            for test, o in outcomes.items():
                slowest[test] = max(slowest.get(test, 0.0), o.seconds)
        # for --durations (pytest_terminal_summary), also from an xdist worker's report
        self.user_properties.append(
            ("mpi_launch", (run.name, result.elapsed, module, sorted(slowest.items())))
        )
        if not result.ok or len(run.outcomes) < run.np:
            incomplete = len(mine) < run.np or not all(
                any(key == n or key.startswith(n + "[") for key in outcomes)
                for outcomes in mine.values()
                for n in self.names
            )
            stopped_here = any(m == module for m, _ in run.stopped_in.values())
            if incomplete or stopped_here or module in run.late:
                raise MPIFailure(run.stopped_in_text() + result.report())
            failures = any(o.status == "failed" for r in run.outcomes.values() for o in r.values())
            if not (run.stopped_in or run.late or failures):  # no test to blame
                raise MPIFailure(result.report())
        names = {frozenset(r) for r in mine.values()}
        if len(names) != 1:
            raise MPIFailure("ranks ran different sets of tests:\n" + result.report())

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, MPIFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"{self.name} ({self.path.name})"


class MPITestItem(MPILaunchItem):
    """One test function, judged by every rank's own pytest result."""

    def __init__(self, *, test_id: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.test_id = test_id

    def runtest(self) -> None:
        run = self.mpi_run
        result = run.run(self.session)
        per_rank: dict[str, list[tuple[str, Outcome]]] = {}
        for rank, outcomes in run.module_outcomes(self.path.name).items():
            per_rank[rank] = [
                (key, o)
                for key, o in outcomes.items()
                if key == self.test_id or key.startswith(self.test_id + "[")
            ]
        if len(per_rank) < run.np or not all(per_rank.values()):
            raise MPIFailure(
                f"{self.test_id}: no result from every rank "
                f"({sum(map(bool, per_rank.values()))} of {run.np} ranks reported it)\n"
                + run.stopped_in_text()
                + result.report()
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


_RUNS = pytest.StashKey[dict[tuple, MPIRun]]()


class MPIModule(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        plan = _module_plan(self.path)
        runs = self.config.stash.setdefault(_RUNS, {})
        rootdir = self.path.parents[2]
        for np in plan.sizes:
            for variant, env in plan.variants.items():
                if variant and np not in plan.variant_sizes.get(variant, (np,)):
                    continue
                if not variant and plan.variants_only:
                    continue
                key = (np, plan.group, tuple(sorted(env.items())), plan.hosts, rootdir)
                mpi_run = runs.get(key)
                # the launch's tag ends every test id of it: "[np=4]", "[np=2-ordered]",
                # "[np=2-large-leaves]", "[np=4-nodes=2]" (tests/conftest.py's xdist
                # scheduling reads it)
                nodes = f"nodes={len(plan.hosts.split(','))}" if plan.hosts else ""
                tag = f"np={np}" + "".join(f"-{x}" for x in (variant, plan.group, nodes) if x)
                if mpi_run is None:
                    mpi_run = runs[key] = MPIRun(np, env, rootdir, f"mpi {tag}", plan.hosts)
                if self.path not in mpi_run.paths:
                    mpi_run.paths.append(self.path)
                items = [
                    MPILaunchItem.from_parent(
                        self, name=f"[{tag}]", mpi_run=mpi_run, names=plan.names
                    ),
                    *(
                        MPITestItem.from_parent(
                            self,
                            name=f"{name}[{tag}]",
                            mpi_run=mpi_run,
                            names=plan.names,
                            test_id=name,
                        )
                        for name in plan.names
                    ),
                ]
                for item in items:
                    if np != FAST_SIZE or variant or plan.group or plan.hosts:
                        item.add_marker(pytest.mark.slow)
                    item.add_marker(pytest.mark.mpi)
                    yield item


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector):
    if os.environ.get(RANK_RUN_VARIABLE) or module_path.parent.name != "mpi":
        return None
    return MPIModule.from_parent(parent, path=module_path)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """With ``--durations``: each MPI launch's time, and its slowest tests as the ranks timed
    them (pytest's own durations see only the item that made the launch). Read from the
    reports, so it works with ``-n`` (pytest-xdist) too."""
    count = config.option.durations
    launches: dict[str, float] = {}
    modules: dict[str, list[tuple[str, list[tuple[str, float]]]]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == "mpi_launch" and getattr(report, "when", "") == "call":
                    name, elapsed, module, tests = value
                    launches[name] = elapsed
                    modules.setdefault(name, []).append((module, tests))
    if count is None or not launches:
        return
    write = terminalreporter.write_line
    terminalreporter.section("MPI launches (one per world size, variant and group)")
    slowest = []
    for name, elapsed in sorted(launches.items(), key=lambda kv: -kv[1]):
        write(f"{elapsed:8.1f}s {name}")
        for module, tests in modules[name]:
            write(f"{sum(s for _, s in tests):14.1f}s {module} ({len(tests)} tests)")
            slowest += [(s, f"{module}::{test}[{name}]") for test, s in tests]
    slowest.sort(reverse=True)
    write(f"slowest MPI tests, the slowest rank's time ({len(slowest)} in all):")
    for seconds, name in slowest[: count or None]:
        write(f"{seconds:8.2f}s {name}")


def pytest_report_header(config: pytest.Config) -> str:
    sizes = os.environ.get(SIZES_VARIABLE, ",".join(map(str, DEFAULT_SIZES)))
    return (
        f"jaxddp MPI harness: tests/mpi/* run as real ranks, world sizes {sizes}, "
        "one launch per world size"
    )


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
_late: list[tuple[str, str]] = []  # (node id or phase, the exception's text)


def _on_rank() -> bool:
    return bool(os.environ.get(RANK_RUN_VARIABLE))


def _through(text: str, root: Path) -> bool:
    """Whether a formatted traceback has a frame in ``root`` outside installed packages."""
    return any(
        line.lstrip().startswith(f'File "{root}') and "site-packages" not in line
        for line in text.splitlines()
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpi: a test of tests/mpi, run as real ranks")
    if _on_rank():
        for name in _LATE_WARNINGS:
            config.addinivalue_line("filterwarnings", f"always::pytest.{name}")


def pytest_runtest_logstart(nodeid: str, location) -> None:
    if _on_rank():
        _started[nodeid] = time.monotonic()
        sys.stderr.write(f"\n{_STARTS}{nodeid}\n")
        sys.stderr.flush()


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    if _on_rank():
        seconds = time.monotonic() - _started.pop(nodeid, time.monotonic())
        status = _status.pop(nodeid, "passed")
        sys.stderr.write(f"\n{_ENDS}{nodeid} {status} {seconds:.2f} s\n")
        sys.stderr.flush()


_started: dict[str, float] = {}  # nodeid -> when it started


_status: dict[str, str] = {}  # nodeid -> the worst outcome of its phases so far


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _on_rank() and report.outcome != "passed" and _status.get(report.nodeid) != "failed":
        _status[report.nodeid] = report.outcome
    if report.failed and _on_rank():
        sys.stderr.write(
            f"\njaxddp test harness: {report.nodeid} failed in {report.when} on this rank:\n"
            f"{report.longreprtext}\n"
        )
        sys.stderr.flush()


def pytest_warning_recorded(warning_message, when, nodeid, location) -> None:
    if type(warning_message.message).__name__ in _LATE_WARNINGS:
        _late.append((nodeid or when, str(warning_message.message)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not (_late and _on_rank()):
        return
    sys.stderr.write(
        "\njaxddp test harness: exceptions in threads or finalizers on this rank (reported "
        "here, at the end, so that no other rank waits for this one):\n"
        + "\n".join(f"{where}: {text}" for where, text in _late)
        + "\n"
    )
    ours = [where for where, text in _late if _through(text, session.config.rootpath)]
    for where in ours:  # the launcher's side blames the module of each
        sys.stderr.write(f"{_LATE}{where}\n")
    sys.stderr.flush()
    if ours:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
