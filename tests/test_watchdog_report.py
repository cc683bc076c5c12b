"""Which ranks the stall report names as behind (jaxddp/_runtime/watchdog/report.py), from the
snapshots the ranks send; the launches of tests/test_stall.py check the report end to end."""

from jaxddp._runtime.watchdog.report import render
from tests.test_stall import behind


def _waiting(events: int, count: int, waiting: str = "a jaxddp collective") -> dict:
    return {
        "count": count,
        "events": events,
        "label": "a jaxddp collective",
        "since": 30.0,
        "user": ["stall.py:1 in <module>"],
        "inner": None,
        "waiting": waiting,
        "exited": None,
    }


def _behind(got: dict) -> str:
    return behind(render(got, 30.0, 5.0, None, aborting=False))


def test_a_rank_with_fewer_events_is_behind_whatever_the_inspector_saw_it_do():
    # rank 1 is one collective short, but spent more ticks compiling than rank 0
    got = {0: _waiting(events=9, count=14), 1: _waiting(events=8, count=15)}
    assert _behind(got) == "1"
    got = {0: _waiting(events=8, count=15), 1: _waiting(events=9, count=14), 2: _waiting(8, 20)}
    assert _behind(got) == "0, 2"


def test_with_the_same_events_the_progress_seen_decides_and_else_no_rank_is_named():
    got = {0: _waiting(events=9, count=14), 1: _waiting(events=9, count=12)}
    assert _behind(got) == "1"
    got = {0: _waiting(events=9, count=14), 1: _waiting(events=9, count=14)}
    assert _behind(got).startswith("none found")


def test_a_rank_outside_jaxddp_or_silent_is_behind_before_any_count():
    got = {0: _waiting(events=3, count=3), 1: _waiting(9, 9, waiting=None), 2: float("nan")}
    report = render(got, 30.0, 5.0, None, aborting=False)
    assert "behind: 1, 2 ====" in report
    assert "rank 2: DID NOT ANSWER" in report
