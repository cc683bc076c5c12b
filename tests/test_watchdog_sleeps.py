"""The stall inspector's reading of a thread's sleeps (jaxddp/_runtime/watchdog/sleeps.py), on real
threads: one that sleeps in short turns as a polling MPI does (MPICH's heavy yield), one that
waits for results that keep coming (a loop of jitted steps), one asleep for good."""

import sys
import threading
import time

import pytest

from jaxddp._runtime.watchdog.sleeps import POLLING_WAKES_PER_SECOND, MainSleeps

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not MainSleeps(threading.get_native_id()).nanosleeps,
    reason="reads Linux's /proc/self/task/<tid>/ on a machine whose sleep calls it knows",
)


def _watched(work):
    """Runs ``work(stop)`` on a thread for half a second; returns its wakes, the seconds
    they were counted over, and whether :meth:`MainSleeps.polling` took them for polling."""
    stop = threading.Event()
    started = threading.Event()
    ids = []

    def run():
        ids.append(threading.get_native_id())
        started.set()
        work(stop)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait()
    sleeps = MainSleeps(ids[0])
    before, at = sleeps.count(), time.monotonic()
    time.sleep(0.5)
    wakes, seconds = sleeps.count() - before, time.monotonic() - at
    polling = sleeps.polling(wakes, seconds)
    stop.set()
    thread.join(1)  # a thread asleep for good is a daemon, left asleep
    return wakes, seconds, polling


def _watched_until(work, enough):
    """:func:`_watched` again (at most five times) until ``enough(wakes, seconds, polling)``:
    for a thread meant to wake as often as a polling one, which a loaded machine may wake
    less, or read in another call."""
    for _ in range(5):
        wakes, seconds, polling = _watched(work)
        if enough(wakes, seconds, polling):
            break
    return wakes, seconds, polling


def _busy(wakes, seconds, polling):
    return wakes > POLLING_WAKES_PER_SECOND * seconds


def test_a_thread_that_sleeps_in_short_turns_is_polling():
    def turns(stop):
        while not stop.is_set():
            time.sleep(0.0001)  # clock_nanosleep, as MPICH's heavy yield in a collective

    wakes, seconds, polling = _watched_until(turns, lambda *reading: reading[2])
    assert wakes > POLLING_WAKES_PER_SECOND * seconds
    assert polling


def test_a_thread_woken_by_results_that_keep_coming_is_not_polling():
    ready = threading.Event()

    def feeder(stop):
        while not stop.is_set():
            ready.set()
            time.sleep(0.0001)

    def waits(stop):  # a futex wait per result, as a loop of jitted steps waits for each
        while not stop.is_set():
            ready.wait(1)
            ready.clear()

    feeding = threading.Event()
    threading.Thread(target=feeder, args=(feeding,), daemon=True).start()
    try:
        wakes, seconds, polling = _watched_until(waits, _busy)
    finally:
        feeding.set()
    assert wakes > POLLING_WAKES_PER_SECOND * seconds  # as many wakes as the polling thread's
    assert not polling


@pytest.mark.parametrize("nap", [3600, 0.05], ids=["asleep for good", "a few naps a second"])
def test_a_thread_asleep_in_its_data_loading_is_not_polling(nap):
    def sleeps(stop):  # clock_nanosleep too, but once, or a few times a second
        while not stop.is_set():
            time.sleep(nap)

    wakes, seconds, polling = _watched(sleeps)
    assert wakes <= POLLING_WAKES_PER_SECOND * seconds
    assert not polling
