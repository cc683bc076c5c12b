"""The stall inspector on real launches: every way a job used to hang now ends it, with a report
that names the ranks behind and the line each one is at.

Each launch runs ``tests/scripts/stall.py MODE`` with ``JAXDDP_STALL_WARN=2
JAXDDP_STALL_ABORT=6`` (the settings take any number of seconds; the defaults and the docs'
example, 5 and 20, would make each launch wait 20 s for what takes 6 here); the harness's own
watchdog (45 s) is the backstop. The misbehaving rank prints the time it misbehaves; the job
must end non-zero within 20 s of it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import default_mpiexec, launch

pytestmark = pytest.mark.slow  # real launches that wait through stall timers

SCRIPTS = Path(__file__).with_name("scripts")
STALL = SCRIPTS / "stall.py"
WARN, ABORT = 2, 6
ENV = {"JAXDDP_STALL_WARN": str(WARN), "JAXDDP_STALL_ABORT": str(ABORT)}
SIZES = [2, 4]
# How the waiting ranks wait: at 2 ranks MPICH's default (they spin in MPI), at 4 ranks in a
# quick launch (tests/harness: MPICH's heavy yield, a nanosleep on every turn of its polling
# loop, which the inspector must not take for progress; jaxddp/_runtime/watchdog/sleeps.py). So each
# stall is caught both ways.
SLEEPING_WAITS_AT = {4}


def line_of(marker: str, script: Path = STALL) -> int:
    """The line number of ``# LINE: marker`` in the script."""
    for n, text in enumerate(script.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# LINE: {marker}"):
            return n
    raise AssertionError(marker)


def run(
    mode: str,
    np: int,
    script: Path = STALL,
    compile_cache: bool = True,
    launcher_args: tuple[str, ...] = (),
    *,
    buffered: bool = False,
    env: dict[str, str] | None = None,
):
    """``buffered``: Python's stdout block-buffered, as under a launcher (not the harness's
    ``PYTHONUNBUFFERED=1``); ``env``: more variables."""
    env = dict(os.environ, **ENV, **(env or {}))
    if buffered:
        env["PYTHONUNBUFFERED"] = ""
    quick = np in SLEEPING_WAITS_AT
    result = launch(
        [str(script), mode],
        np,
        timeout=45,
        env=env,
        compile_cache=compile_cache,
        quick=quick,
        launcher_args=launcher_args,
    )
    ended = time.time()
    assert not result.timed_out, result.report()
    assert result.returncode != 0, result.report()
    logs = "\n".join(result.rank_logs.values())
    found = re.search(r"rank (\d+) misbehaves at ([\d.]+)", logs)
    assert found, result.report()
    assert ended - float(found.group(2)) < ABORT + 14, result.report()
    return result


def report_of(result) -> str:
    """Rank 0's last stall report."""
    log = result.rank_logs["0"]
    assert "==== jaxddp stall report" in log, result.report()
    return log.split("==== jaxddp stall report")[-1]


def assert_printed_lines_kept(result) -> None:
    """Every rank's unflushed line of batch 2 (``stall.py``) reached its log before the abort."""
    for r in range(result.np):
        line = f"rank {r} printed this at batch 2 and did not flush it"
        assert line in result.rank_logs[str(r)], result.report()


def rank_lines(report: str, r: int) -> str:
    """The lines of the report about rank ``r``."""
    block = report.split(f"\nrank {r}: ", 1)[1]
    return block.split("\nrank ", 1)[0]


def behind(report: str) -> str:
    return report.split("behind: ", 1)[1].split(" ====", 1)[0]


@pytest.mark.parametrize("np", SIZES)
def test_a_rank_asleep_in_its_data_loading_is_named_with_its_line(np):
    result = run("sleep", np, buffered=True)
    assert_printed_lines_kept(result)  # rank 0's inspector aborts
    report = report_of(result)
    last = np - 1
    assert behind(report) == str(last), report
    assert f"rank {last}: BEHIND: not in jaxddp" in report
    assert f"at tests/scripts/stall.py:{line_of('sleep')} in load_batch" in rank_lines(report, last)
    for r in range(last):
        assert "waiting in the compiled function `step`" in rank_lines(report, r), report
    assert "aborting every rank with MPI_Abort" in report


def test_ranks_waiting_in_an_xla_collective_are_reported_with_where():
    # JAXDDP_COLLECTIVES=xla, without the per-call check: rank 0 runs its step and waits for
    # the XLA (gloo) collective that the sleeping rank never joins (in the step's call, or
    # in `float(loss)` where XLA runs it asynchronously)
    result = run("sleep", 2, env={"JAXDDP_COLLECTIVES": "xla", "JAXDDP_CHECK": "0"})
    report = report_of(result)
    assert behind(report) == "1", report
    assert f"at tests/scripts/stall.py:{line_of('sleep')} in load_batch" in rank_lines(report, 1)
    waiting = rank_lines(report, 0)
    assert waiting.startswith("waiting in jaxddp (a collective, or a compiled step's result)")
    assert re.search(
        rf"at tests/scripts/stall.py:({line_of('step')}|{line_of('loss')}) in <module>", waiting
    ), report
    assert "aborting every rank with MPI_Abort" in report


def test_a_rank_asleep_is_named_across_two_nodes():
    """2 nodes x 2 ranks (MPICH's hydra simulates them here, TCP between them): the report
    travels between nodes as within one."""
    result = run("sleep", 4, launcher_args=("-launcher", "fork", "-hosts", "n0:2,n1:2"))
    report = report_of(result)
    assert behind(report) == "3", report
    assert f"at tests/scripts/stall.py:{line_of('sleep')} in load_batch" in rank_lines(report, 3)
    for r in range(3):
        assert "waiting in the compiled function `step`" in rank_lines(report, r), report
    assert "aborting every rank with MPI_Abort" in report


@pytest.mark.parametrize("np", SIZES)
def test_a_collective_only_on_rank_0(np):
    result = run("rank0_only", np)
    report = report_of(result)
    assert behind(report) == ", ".join(str(r) for r in range(1, np)), report
    mine = rank_lines(report, 0)
    assert f"at tests/scripts/stall.py:{line_of('rank0_only')} in <module>" in mine, report
    assert "waiting in jaxddp" in mine
    assert "EXITED" in rank_lines(report, 1)


@pytest.mark.parametrize("np", SIZES)
def test_a_rank_that_breaks_out_and_exits_0(np):
    result = run("break_exit", np)
    report = report_of(result)
    last = np - 1
    assert behind(report) == str(last), report
    mine = rank_lines(report, last)
    assert "EXITED" in mine, report
    assert f"sys.exit(0) at tests/scripts/stall.py:{line_of('exit0')}" in mine, report


@pytest.mark.parametrize("np", SIZES)
def test_a_rank_killed_with_sigkill_ends_the_job(np):
    result = run("sigkill", np)
    # MPICH's mpiexec ends the job itself when a rank dies of a signal
    assert "Killed (signal 9)" in result.output or result.returncode in (9, 137), result.report()


@pytest.mark.parametrize("np", SIZES)
def test_a_stopped_rank_is_named_as_not_answering(np):
    result = run("sigstop", np)
    report = report_of(result)
    last = np - 1
    assert behind(report) == str(last), report
    assert f"rank {last}: DID NOT ANSWER" in report


@pytest.mark.parametrize("np", SIZES)
def test_rank_0_blocked_holding_the_gil_is_named_and_aborted_by_rank_1(np):
    """Rank 0 leads the stall inspector; with its GIL held in C code none of its Python
    threads runs, so rank 1 stands in: it names rank 0 and aborts the job itself."""
    result = run("gil0", np, buffered=True)
    # rank 1 aborts; rank 0, holding the GIL, cannot flush: its line was written when printed
    assert_printed_lines_kept(result)
    log = result.rank_logs["1"]
    assert "==== jaxddp stall report" in log, result.report()
    report = log.split("==== jaxddp stall report")[-1]
    assert behind(report).startswith("0"), report
    assert "rank 0: DID NOT ANSWER" in report
    assert "reported by rank 1: rank 0, whose stall inspector leads" in report
    assert "aborting every rank with MPI_Abort" in report
    for r in range(1, np):
        assert "waiting in the compiled function `step`" in rank_lines(report, r), report


@pytest.mark.parametrize(("mode", "inspector"), [("exit", "on"), ("wait", "on"), ("wait", "off")])
def test_lines_printed_before_another_rank_aborts_reach_the_file(mode, inspector, tmp_path):
    """The job's stdout redirected to a file, Python's buffered (``PYTHONUNBUFFERED`` empty):
    every line both ranks printed without flushing (``tests/scripts/abort_output.py``) must
    be there after the last rank's ``sys.exit(1)`` (rank 0 waiting at its exit) or exception
    (rank 0 waiting in a collective) aborted the job. They used to die in the buffers of the
    killed ranks (with the stall inspector off, rank 0's every time), and hydra dropped what
    it had not read of a rank's pipe when the abort reached it."""
    env = dict(os.environ, PYTHONUNBUFFERED="")
    if inspector == "off":
        env["JAXDDP_STALL_WARN"] = "0"
    out = tmp_path / "out.txt"
    # run through `python -c`, as a program started by a launcher script: there the lines
    # were lost every time (from a script file, Python's own exit path kept them for `exit`)
    script = str(SCRIPTS / "abort_output.py")
    code = (
        f"import runpy, sys; sys.argv = [{script!r}, {mode!r}]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    command = [default_mpiexec(), "-n", "2", sys.executable, "-c", code]
    with out.open("w") as f:
        done = subprocess.run(
            command, check=False, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=60
        )
    text = out.read_text()
    assert done.returncode != 0, text[-3000:]
    assert "aborting every rank with MPI_Abort" in text, text[-3000:]
    for r, what in ((0, "before"), (1, "before"), (1, "last")):
        found = re.findall(
            rf"^rank {r} {what} line (\d+) of (\d+), not flushed$", text, re.MULTILINE
        )
        assert found, f"none of rank {r}'s {what!r} lines:\n{text[-3000:]}"
        lines = int(found[0][1])
        missing = sorted(set(range(lines)) - {int(i) for i, _ in found})
        assert not missing, f"rank {r}'s {what!r} lines {missing[:5]}... missing of {lines}"


@pytest.mark.parametrize("unbuffered", [True, False], ids=["PYTHONUNBUFFERED", "buffered"])
def test_a_rank_printing_steadily_while_another_raises_keeps_every_line_whole(unbuffered, tmp_path):
    """Rank 0 prints 1 KB lines steadily (``tests/scripts/abort_output.py steady``) until
    rank 1's exception aborts the job: every line whose ``print`` returned must be in the
    job's output, and every line whole. Rank 0 used to go on printing after it had flushed
    and lose its last lines (in 6 of 8 such jobs); with ``PYTHONUNBUFFERED`` another rank's
    line came between a line's text and its newline."""
    env = dict(os.environ, PYTHONUNBUFFERED="1" if unbuffered else "")
    out = tmp_path / "out.txt"
    command = [default_mpiexec(), "-n", "2", sys.executable, str(SCRIPTS / "abort_output.py")]
    with out.open("w") as f:
        done = subprocess.run(
            [*command, "steady", str(tmp_path)],
            check=False, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=60,
        )  # fmt: skip
    text = out.read_text()
    assert done.returncode != 0, text[-3000:]
    assert "RuntimeError: the last rank fails while the others print" in text, text[-3000:]
    whole = re.compile(r"^rank 0 steady line (\d{7}) x{1000}$")
    lines = text.splitlines()
    broken = [line[:150] for line in lines if "steady line" in line and not whole.match(line)]
    assert broken == [], broken[:3]
    got = {int(m.group(1)) for line in lines if (m := whole.match(line))}
    printed = {int(i) for i in (tmp_path / "truth-0").read_text().split()}
    assert len(printed) > 100
    missing = sorted(printed - got)
    assert missing == [], f"{len(missing)} of {len(printed)} printed lines missing: {missing[:5]}"


@pytest.mark.parametrize("np", SIZES)
def test_gradient_trees_that_differ_without_the_check(np):
    # Off the compilation cache: there the other ranks' `step` is cached from the launches
    # before, and only the last rank's (one leaf more) compiles, so on a loaded machine
    # they could wait ABORT s for that compile alone and be aborted as stalled
    result = run("tree", np, compile_cache=False)
    report = report_of(result)
    last = np - 1
    assert behind(report) == str(last), report
    assert f"at tests/scripts/stall.py:{line_of('step')} in <module>" in rank_lines(report, last)
    for r in range(last):
        assert f"at tests/scripts/stall.py:{line_of('metrics')} in <module>" in rank_lines(
            report, r
        ), report


@pytest.mark.parametrize("np", SIZES)
def test_a_rank_that_exits_1_ends_the_job_at_once(np):
    result = run("exit1", np)
    log = result.rank_logs[str(np - 1)]
    assert f"called sys.exit(1) at tests/scripts/stall.py:{line_of('exit1')}" in log
    assert "aborting every rank with MPI_Abort" in log
    assert result.after_first_text < 30, result.report()  # their start not counted
    assert "==== jaxddp stall report" not in result.rank_logs["0"]


@pytest.mark.parametrize("np", SIZES)
def test_a_rank_that_raises_before_importing_jaxddp(np):
    result = run("-", np, script=SCRIPTS / "raise_before_import.py")
    last = str(np - 1)
    assert "FileNotFoundError" in result.rank_logs[last], result.report()
    # Each waiting rank's watcher fires about ABORT s after its own start; once the first kills
    # its rank, mpiexec may end the others before theirs fire.
    told = [result.rank_logs[str(r)] for r in range(np - 1)]
    told = [log for log in told if f"waited {ABORT} s in MPI_Init" in log]
    assert told, result.report()
    for log in told:
        assert "a rank probably died before initializing MPI" in log
        assert "Look for its traceback" in log


@pytest.fixture(scope="module")
def healthy():
    """One job for the three healthy runs (``stall.py healthy``, each its own lines): a rank
    that catches a ``SystemExit`` and goes on, then 8 batches of 1 s each on the last rank,
    then 6 s of jitted steps, then 5 s of waiting for a moving checkpoint write, under a 3 s
    warning (the ratio of the 2 s and 5 s these tests
    used to wait through), with MPICH's sleeping waits. tests/conftest.py runs the three
    tests on one xdist worker."""
    env = dict(os.environ, JAXDDP_STALL_WARN="3")
    # with MPICH's sleeping waits: their wakes are not progress, and a healthy loop must
    # still be seen as one (by the same wakes of a step's result that it relies on at
    # MPICH's default; test_examples.py's digits run checks a healthy job there too)
    result = launch([str(STALL), "healthy", "1", "6"], 2, timeout=150, env=env, quick=True)
    assert result.ok, result.report()
    for log in result.rank_logs.values():
        assert "stall report" not in log, result.report()
    return result


def test_a_slow_but_progressing_rank_gets_no_report(healthy):
    for r, log in healthy.rank_logs.items():
        assert f"rank {r} finished\n" in log, healthy.report()


def test_a_loop_of_jitted_steps_alone_gets_no_report(healthy):
    """At least 6 s of steps whose collectives are all compiled (no sampler, no jaxddp call
    from Python for the 20 steps between two checks, several seconds each): the main thread
    waits for each step's result at the same line, and dispatches the next in between. The
    inspector must see that as progress."""
    for log in healthy.rank_logs.values():
        assert re.search(r"finished \d+ steps", log), healthy.report()


def test_a_rank_waiting_for_a_checkpoint_write_that_moves_gets_no_report(healthy):
    """Rank 0 waits 5 s (past the 3 s warning) for a write that keeps writing, the others
    wait for it in a broadcast: the bytes growing count as progress."""
    waited = re.search(r"waited ([\d.]+) s for a moving write", healthy.rank_logs["0"])
    assert waited, healthy.report()
    assert 5 <= float(waited.group(1)) < 15, healthy.report()  # the whole write, not less


def test_a_caught_sys_exit_followed_by_more_work_is_not_an_exit(healthy):
    for log in healthy.rank_logs.values():
        assert "caught SystemExit(2)" in log
        assert "went on: 2.0" in log
        assert "MPI_Abort" not in log
