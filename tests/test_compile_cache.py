"""The suite's shared compilation cache (tests/harness/rank.py: ``ClaimingCache``): the
ranks of a launch compile a program once between them, a reader never sees half an entry,
and no rank waits for a claim that nobody will fulfil."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.harness import COMPILE_CACHE_VARIABLE, launch
from tests.harness import rank as rank_py

ClaimingCache = rank_py.ClaimingCache


def waiting_get(cache, key: str) -> dict:
    """``cache.get(key)`` in a thread; the dict gets its value and when it returned."""
    out: dict = {}

    def get() -> None:
        out["value"] = cache.get(key)
        out["ended"] = time.monotonic()

    out["thread"] = threading.Thread(target=get)
    out["thread"].start()
    return out


def test_the_second_to_miss_waits_for_the_firsts_entry(tmp_path):
    first, second = ClaimingCache(str(tmp_path)), ClaimingCache(str(tmp_path))
    assert first.get("k") is None  # a miss: claimed, this one compiles
    assert (tmp_path / "k-claim").exists()
    waiter = waiting_get(second, "k")
    time.sleep(0.3)
    assert waiter["thread"].is_alive()  # waiting, not compiling
    put_at = time.monotonic()
    first.put("k", b"executable")
    waiter["thread"].join(5)
    assert waiter["value"] == b"executable"
    assert waiter["ended"] >= put_at  # it waited for the entry
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k-cache"]  # no claim, no part
    assert ClaimingCache(str(tmp_path)).get("k") == b"executable"  # a later process: a hit


def test_a_claim_given_up_without_an_entry_ends_the_wait(tmp_path):
    first, second = ClaimingCache(str(tmp_path)), ClaimingCache(str(tmp_path))
    assert first.get("k") is None
    waiter = waiting_get(second, "k")
    time.sleep(0.2)
    assert waiter["thread"].is_alive()
    # the claimer asks for its next program: JAX wrote no entry for "k" (its compile ended)
    assert first.get("other") is None
    waiter["thread"].join(5)
    assert waiter["value"] is None  # the waiter compiles it itself
    assert not (tmp_path / "k-claim").exists()


def test_a_dead_claimers_claim_is_taken_over_at_once(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    (tmp_path / "k-claim").write_text(gone.stdout.strip())
    start = time.monotonic()
    assert ClaimingCache(str(tmp_path)).get("k") is None
    assert time.monotonic() - start < 1
    assert not (tmp_path / "k-claim").exists()


def test_a_claim_nobody_fulfils_is_waited_for_at_most_claim_wait(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(rank_py, "CLAIM_WAIT", 0.3)
    (tmp_path / "k-claim").write_text(str(1))  # init: alive, and never writes the entry
    start = time.monotonic()
    assert ClaimingCache(str(tmp_path)).get("k") is None
    assert 0.3 <= time.monotonic() - start < 3
    assert "compiling k here" in capfd.readouterr().err


PROGRAM = """
import jax, jax.numpy as jnp
from jax import monitoring
counts = {}
monitoring.register_event_listener(lambda name, **kw: counts.__setitem__(name, counts.get(name, 0) + 1))
import jaxddp
out = jax.jit(lambda x: jnp.tanh(x) * 3 + jaxddp.allreduce(x, op="sum"))(jnp.ones(64))
value = "%.4f" % out[0]
print("hits", counts.get("/jax/compilation_cache/cache_hits", 0),
      "writes", counts.get("/jax/compilation_cache/cache_misses", 0), "value", value)
"""


@pytest.mark.slow
def test_the_ranks_of_a_launch_compile_each_program_once(tmp_path):
    """Real ranks through rank.py: of two ranks compiling the same programs at the same
    time, one compiles and writes each and the other reads it."""
    env = {**os.environ, COMPILE_CACHE_VARIABLE: str(tmp_path)}
    result = launch(["-c", PROGRAM], 2, timeout=90, env=env)
    assert result.ok, result.report()
    lines = {r: log.split("hits", 1)[1].split() for r, log in result.rank_logs.items()}
    hits = sum(int(words[0]) for words in lines.values())
    writes = sum(int(words[2]) for words in lines.values())
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert all(name.endswith("-cache") for name in entries), entries  # no claims, no parts
    # no program compiled twice (JAX's own cache: both ranks miss, both write each one),
    # and the programs both ranks run compiled by one of them and read by the other
    assert writes <= len(entries), (lines, entries)
    assert hits >= 3, lines  # the step, its allreduce's and the slice's helpers at least
    assert [words[4] for words in lines.values()] == ["4.2848"] * 2  # 3 tanh(1) + 1 + 1
