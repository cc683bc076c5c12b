"""The launcher report, its errors, and the one renderer of every launcher text.

Every table of the launcher check (a refusal, a warning, the silent-singleton error, the
doctor's output) is written by :func:`table_lines`, :func:`fix_lines` and :func:`compose`.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any

from .judge import Verdict

__all__ = [
    "LauncherMismatchError",
    "LauncherReport",
    "LauncherWarning",
    "compose",
    "fix_lines",
    "table_lines",
    "wrap",
]

WIDTH = 100
KEY_WIDTH = 13  # "MPI library: " and the like, so that values line up

Rows = Sequence[tuple[str, str]]


class LauncherMismatchError(RuntimeError):
    """The launcher and the MPI library cannot work together.

    Raised before ``MPI_Init`` when the launcher does not offer the process-management
    interface that the MPI library speaks, and after ``MPI_Init`` when MPI reports a world
    of 1 although the launcher started more processes (a "silent singleton").
    """


class LauncherWarning(UserWarning):
    """The launcher and the MPI library may not work together; jaxddp cannot tell for sure."""


def wrap(text: str, first: str = "", then: str = "") -> list[str]:
    """Wraps ``text`` to 100 columns, keeping paths and options whole."""
    return textwrap.wrap(
        text,
        width=WIDTH,
        initial_indent=first,
        subsequent_indent=then,
        break_on_hyphens=False,
        break_long_words=False,
    )


def table_lines(rows: Rows, indent: str = "", *, wrapped: bool = True) -> list[str]:
    """``key: value`` rows with the values aligned; long values wrap under themselves."""
    lines: list[str] = []
    for key, value in rows:
        row = f"{key + ':':<{KEY_WIDTH}}{value}"
        lines += wrap(row, indent, indent + " " * KEY_WIDTH) if wrapped else [indent + row]
    return lines


def fix_lines(fixes: Sequence[str], indent: str = "  ") -> list[str]:
    """The "How to fix it:" list, one wrapped bullet per fix; nothing when there is none."""
    if not fixes:
        return []
    lines = [f"{indent}How to fix it:"]
    for fix in fixes:
        lines += wrap(fix, f"{indent}- ", indent + "  ")
    return lines


def compose(head: str, rows: Rows, reason: str, fixes: Sequence[str]) -> str:
    """A message: the head line, the table, the reason and the fixes, wrapped to 100."""
    return "\n".join([head, *table_lines(rows, "  "), *wrap(reason, "  ", "  "), *fix_lines(fixes)])


_HEADS = {
    Verdict.OK: "jaxddp: the launcher matches the MPI library.",
    Verdict.DOUBTFUL: "jaxddp: the launcher may not match the MPI library.",
    Verdict.MISMATCH: "jaxddp: the launcher does not match the MPI library; refusing to start MPI.",
}


@dataclasses.dataclass(frozen=True)
class LauncherReport:
    """What :func:`check_launcher` found, and its verdict.

    Attributes:
      launcher: the launcher that started this process, e.g. ``"MPICH mpiexec (hydra)"``,
        ``"Open MPI mpiexec (PRRTE, Open MPI 5 or later)"``, ``"srun --mpi=pmi2"``; ``"none"`` without one.
      pmi: the process-management interface the launcher offers: ``"PMI-1/2"``,
        ``"PMIx"``, ``"PMI-1/2 and PMIx"`` or ``"none"``.
      library: the MPI library's vendor (``"MPICH"``, ``"Open MPI"``, ``"Intel MPI"``,
        ``"MVAPICH"``, ``"Cray MPICH"``, ...), ``"unknown"`` when not recognised.
      library_version: its version, ``""`` when unknown.
      library_pmi: the interface the library speaks: ``"PMI-1/2"``, ``"PMIx"`` or
        ``"PMI-1/2 and PMIx"`` (an MPICH built with PMIx); ``"unknown"``.
      world_size: how many processes the launcher says it started, ``None`` when it does
        not say (no launcher, or ``srun --mpi=pmix``).
      world_size_source: the variable ``world_size`` was read from, e.g. ``"PMI_SIZE"``.
      rank: this process's rank according to the launcher, ``None`` when it does not say.
      verdict: a :class:`Verdict`, equal to ``"ok"``, ``"doubtful"`` (a
        :class:`LauncherWarning`) or ``"mismatch"`` (a :class:`LauncherMismatchError` unless
        forced).
      reason: why, in sentences.
      fixes: what to do about it, most direct first; empty when the verdict is ``"ok"``.
      evidence: the deciding environment variables, as ``NAME=value``.
    """

    launcher: str
    pmi: str
    library: str
    library_version: str
    library_pmi: str
    world_size: int | None
    world_size_source: str
    rank: int | None
    verdict: Verdict
    reason: str
    fixes: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """False only for a mismatch: ``"doubtful"`` still lets jaxddp start."""
        return self.verdict is not Verdict.MISMATCH

    @property
    def library_name(self) -> str:
        """The library with its version, e.g. ``"MPICH 5.0.2"``."""
        return f"{self.library} {self.library_version}".strip()

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``jaxddp doctor --json``)."""
        out = dataclasses.asdict(self)
        out["verdict"] = self.verdict.value
        out["fixes"] = list(self.fixes)
        out["evidence"] = list(self.evidence)
        return out

    def rows(self) -> list[tuple[str, str]]:
        """The report's table as ``(key, value)`` rows."""
        size = "not announced" if self.world_size is None else str(self.world_size)
        if self.world_size_source:
            size += f" ({self.world_size_source})"
        rows = [
            ("launcher", self.launcher),
            ("PMI offered", self.pmi),
            ("MPI library", f"{self.library_name} (speaks {self.library_pmi})"),
            ("world size", size),
            ("verdict", str(self.verdict)),
        ]
        if self.evidence:
            rows.append(("evidence", ", ".join(self.evidence)))
        return rows

    def summary(self) -> str:
        """The report as an aligned table, one line per field."""
        return "\n".join(table_lines(self.rows(), wrapped=False))

    def lines(self, indent: str = "  ") -> list[str]:
        """The table and the reason, wrapped to 100 columns, as the doctor prints them."""
        return [*table_lines(self.rows(), indent), *wrap(self.reason, indent, indent)]

    def message(self) -> str:
        """The full text of a refusal or warning: what was found, why, and the fixes."""
        return compose(_HEADS[self.verdict], self.rows(), self.reason, self.fixes)

    def __str__(self) -> str:
        return self.message()
