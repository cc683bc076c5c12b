"""The stall report rank 0 prints: every rank's progress and place, the ranks behind first."""

from __future__ import annotations

import math
from typing import Any

# -- the report ---------------------------------------------------------------------------


def _behind(entry: dict[str, Any] | float) -> bool:
    return not isinstance(entry, dict) or entry["exited"] is not None or entry["waiting"] is None


def _least_progress(got: dict[int, dict[str, Any] | float]) -> list[int]:
    """When every rank waits, those that made the least progress (they wait elsewhere):
    compared by jaxddp's own events first (batches drawn, jaxddp functions called from
    Python: the same on every rank of a program in step), then by all progress seen, which
    adds what the inspector saw the main thread do (ticks spent compiling, wakes), a count
    that differs between ranks by timing alone. None where every rank made the same."""
    for key in ("events", "count"):
        counts = {r: e[key] for r, e in got.items() if isinstance(e, dict)}
        if len(set(counts.values())) > 1:
            return [r for r in sorted(counts) if counts[r] == min(counts.values())]
    return []


def render(
    got: dict[int, dict[str, Any] | float],
    stalled: float,
    warn: float,
    abort: float | None,
    *,
    aborting: bool,
) -> str:
    """The stall report, as rank 0 prints it: the ranks behind first."""
    size = len(got)
    behind = [r for r in sorted(got) if _behind(got[r])] or _least_progress(got)
    others = [r for r in sorted(got) if r not in behind]
    named = ", ".join(map(str, behind)) if behind else "none found (every rank waits in jaxddp)"
    lines = [
        "",
        (
            f"==== jaxddp stall report: no rank has made progress for {stalled:.0f} s "
            f"(JAXDDP_STALL_WARN={warn:g}); {size} ranks; behind: {named} ===="
        ),
    ]
    for r in behind + others:
        entry = got[r]
        if not isinstance(entry, dict):
            heard = "" if math.isnan(entry) else f"; last heard from {entry:.0f} s ago"
            lines.append(
                f"rank {r}: DID NOT ANSWER (exited, killed, or blocked where Python cannot "
                f"run){heard}"
            )
            continue
        progress = f"progress {entry['count']} ({entry['label']}), last {entry['since']:.0f} s ago"
        if entry["exited"] is not None:
            seconds, how = entry["exited"]
            state = f"EXITED {seconds:.0f} s ago ({how}), the others may wait for it"
        elif entry["waiting"] is not None:
            state = f"{'BEHIND, ' if r in behind else ''}waiting in {entry['waiting']}"
        else:
            state = "BEHIND: not in jaxddp, nor in a compiled step"
        lines.append(f"rank {r}: {state}; {progress}")
        if entry["exited"] is None:
            for i, frame in enumerate(entry["user"]):
                lines.append(f"    {'at' if i == 0 else '  '} {frame}")
            if entry["inner"] is not None:
                lines.append(f"       (innermost, folded: {entry['inner']})")
    if aborting:
        lines.append(
            f"jaxddp: no progress for {stalled:.0f} s (JAXDDP_STALL_ABORT={abort:g}): "
            "aborting every rank with MPI_Abort."
        )
    else:
        lines.append(
            "(repeats at most every JAXDDP_STALL_WARN s; JAXDDP_STALL_ABORT=<seconds> ends a "
            "stalled job; see 'When a job hangs' in jaxddp's docs)"
        )
    return "\n".join(lines) + "\n"
