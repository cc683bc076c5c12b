"""A rank's output in an abort (jaxddp/_base/streams.py), in small processes without MPI: a
line leaves in one write, and a held output keeps what was printed and holds the rest. On
real launches: tests/test_stall.py::test_lines_printed_before_another_rank_aborts_reach_the_file.

Each child loads streams.py by its path (it imports the standard library alone), with its
stdout a pipe that this process reads, as a launcher does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

STREAMS = Path(__file__).resolve().parents[1] / "jaxddp" / "_base" / "streams.py"
LOAD = f"""
import importlib.util, os, signal, sys, threading, time
spec = importlib.util.spec_from_file_location("streams", {str(STREAMS)!r})
streams = importlib.util.module_from_spec(spec)
spec.loader.exec_module(streams)
"""
LINE = re.compile(r"^child (\d) line (\d+) x{200}$")


def _run(code: str, *, unbuffered: bool, children: int = 1, status: int = 0) -> list[str]:
    """Runs ``children`` copies of ``code`` (``CHILD`` is each one's number, ``START`` a
    moment a little ahead, the same for all) with one pipe as their stdout; checks that each
    ended with ``status``; returns the pipe's lines."""
    env = dict(os.environ, PYTHONUNBUFFERED="1" if unbuffered else "")
    start = time.time() + 1.0
    read, write = os.pipe()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD + f"CHILD, START = {n}, {start}\n" + textwrap.dedent(code)],
            stdout=write,
            env=env,
        )
        for n in range(children)
    ]
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read()
    assert [p.wait(60) for p in procs] == [status] * children
    return out.decode(errors="replace").splitlines()


@pytest.mark.parametrize("unbuffered", [True, False], ids=["PYTHONUNBUFFERED", "buffered"])
def test_two_processes_printing_into_one_pipe_never_merge_two_lines(unbuffered):
    # With PYTHONUNBUFFERED, print wrote a line's text and its newline with two writes, and
    # the other process's line came between them: two lines on one. Both print for the same
    # half second.
    lines = _run(
        """
        streams.line_buffered()
        time.sleep(max(0, START - time.time()))
        i = 0
        while time.time() < START + 0.5 or i <= 100:  # a child started late still prints
            print(f"child {CHILD} line {i} " + "x" * 200)
            i += 1
        """,
        unbuffered=unbuffered,
        children=2,
    )
    broken = [line for line in lines if not LINE.match(line)]
    assert broken == [], broken[:3]
    for child in "01":
        got = [int(m.group(2)) for line in lines if (m := LINE.match(line)) and m.group(1) == child]
        assert got == list(range(len(got)))
        assert len(got) > 100


HOLD_WHILE_PRINTING = """
streams.line_buffered()
truth = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

returned = 0

def printer():
    global returned
    while True:
        print(f"child {CHILD} line {returned} " + "x" * 200)
        os.write(truth, b"%d\\n" % returned)  # print returned: the line is printed
        returned += 1
        time.sleep(0.0001)

threading.Thread(target=printer, daemon=True).start()
deadline = time.time() + 30
while returned <= 150:  # printing steadily when the hold comes
    assert time.time() < deadline, "the printer did not print 150 lines in 30 s"
    time.sleep(0.01)
streams.hold()
assert streams.wait_until_read(5)
# The printer waits in its write: what it records stops growing. Not at once: a print that
# returned just before the hold is recorded a moment later (the thread may lose the GIL
# between the two), so a record after the hold is no proof; records for 5 s are. Stopped
# means the same size at three looks 0.3 s apart.
deadline, sizes = time.time() + 5, [-1]
while sizes[-3:] != [sizes[-1]] * 3:
    assert time.time() < deadline, "lines were printed while the output was held"
    time.sleep(0.3)
    sizes.append(os.fstat(truth).st_size)
os.kill(os.getpid(), signal.SIGKILL)  # as an abort ends a held rank
"""


def test_a_held_output_keeps_every_line_printed_and_holds_the_next(tmp_path):
    truth = tmp_path / "truth"
    lines = _run(
        HOLD_WHILE_PRINTING.replace("sys.argv[1]", repr(str(truth))), unbuffered=False, status=-9
    )
    printed = [int(i) for i in truth.read_text().split()]
    assert len(printed) > 100
    got = [int(LINE.match(line).group(2)) for line in lines]  # every line whole
    assert got == printed  # every line printed, in order; none after the hold


def test_a_released_output_passes_on_what_waited():
    lines = _run(
        """
        streams.line_buffered()
        print("before")
        sys.stdout.write("a line not yet ended")
        streams.hold()
        done = threading.Event()
        threading.Thread(target=lambda: (print("while held"), done.set()), daemon=True).start()
        time.sleep(0.3)
        assert not done.is_set()  # waiting in its write
        streams.release()
        assert done.wait(5)
        print("after")
        """,
        unbuffered=True,
    )
    # the line not yet ended is ended when the output is held: no other line joins it;
    # what waited is passed on by a thread, beside what is printed after
    assert lines[:2] == ["before", "a line not yet ended"]
    assert sorted(lines[2:]) == ["after", "while held"]
