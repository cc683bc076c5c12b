"""jaxddp's own allreduce handler (jaxddp/_native): built from an empty cache, the fallback to
mpi4jax's where it cannot be built, and every rank using the same one.

Its values across ranks are tested by the whole MPI suite, which runs it (tests/mpi/
test_comm.py checks that it does); its speed is measured in benchmarks/, not here.
"""

import json
import os
from pathlib import Path

import pytest

from tests.harness import fresh_python, launch

SCRIPTS = Path(__file__).with_name("scripts")

# One process, world of 1 (where an allreduce is the identity, no custom call): the handler
# chosen and why, values, and what the cache holds.
PROBE = """
import json, jax, jax.numpy as jnp, numpy as np, jaxddp
from jaxddp import _native
jaxddp.rank()  # starts jaxddp's world, which picks the handler
f = jax.jit(lambda x, n: (jaxddp.allreduce(x, op="sum"), jaxddp.allreduce(n, op="max")))
x, n = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4), jnp.arange(5, dtype=jnp.int32)
a, b = f(x, n)
empty = jax.jit(lambda e: jaxddp.allreduce(e, op="sum"))(jnp.zeros((0, 3), jnp.float32))
print(json.dumps({
    "status": _native.status(), "target": _native.allreduce_target(),
    "values_ok": bool(np.array_equal(a, x) and np.array_equal(b, n)),
    "empty_ok": empty.shape == (0, 3),
    "cached": sorted(p.suffix for p in _native.cache_dir().glob("allreduce-*.so")),
}))
"""


def _probe(tmp_path, **env):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env}
    out = fresh_python(["-c", PROBE], env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a real build (~5 s of the C++ compiler) and a launch
def test_it_builds_into_an_empty_cache_and_every_rank_runs_it(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = launch([str(SCRIPTS / "native_allreduce.py"), "agree"], 2, timeout=300, env=env)
    assert result.ok, result.report()
    rows = [json.loads(log.strip().splitlines()[-1]) for log in result.rank_logs.values()]
    assert len(rows) == 2, result.report()
    for row in rows:
        assert row["target"] == "jaxddp_allreduce", row["status"]
        assert row["in_hlo"]
        assert not row["mpi4jax_in_hlo"]
        assert row["values_ok"]
        assert row["shared_calls"] == [1, 1]  # both ranks on this node: in shared memory
    built = sorted(p.name for p in (tmp_path / "cache" / "jaxddp" / "native").iterdir())
    assert [Path(name).suffix for name in built] == [".lock", ".so"]  # one build, no scratch


def test_without_a_compiler_jitted_allreduces_use_mpi4jax_and_doctor_says_why(tmp_path):
    probe = _probe(tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert probe["target"] is None
    assert "no C++ compiler" in probe["status"]
    assert "no-such-c++" in probe["status"]
    assert probe["values_ok"]
    assert probe["empty_ok"]
    assert probe["cached"] == []


def test_turned_off_it_is_neither_built_nor_used(tmp_path):
    probe = _probe(tmp_path, JAXDDP_NATIVE_ALLREDUCE="off")
    assert probe["target"] is None
    assert "JAXDDP_NATIVE_ALLREDUCE is off" in probe["status"]
    assert probe["values_ok"]
    assert probe["cached"] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "name", "value", "unset"),
    [
        ("split", "JAXDDP_NATIVE_ALLREDUCE", "'0' (off)", "on"),
        ("split-shared", "JAXDDP_SHARED_ALLREDUCE", "'0' (off)", "on"),
        ("split-check", "JAXDDP_CHECK", "'off' (off)", "on"),
        ("split-collectives", "JAXDDP_COLLECTIVES", "'xla' (xla)", "mpi"),
    ],
)
def test_ranks_that_disagree_on_a_setting_of_the_collectives_all_raise(mode, name, value, unset):
    # A setting that changes what a collective sends or checks, set on rank 1 only: every
    # rank raises the same error naming it and each rank's value when the world starts, before
    # any collective (JAXDDP_CHECK=0 on one rank used to hang the first eager allreduce).
    result = launch([str(SCRIPTS / "native_allreduce.py"), mode], 2, timeout=180, quick=True)
    assert result.ok, result.report()
    rows = [json.loads(log.strip().splitlines()[-1]) for log in result.rank_logs.values()]
    assert len(rows) == 2, result.report()
    for row in rows:
        assert row.keys() == {"error"}, row
        assert row["error"].startswith(f"{name} differs across the ranks: "), row
        assert f"rank 0 has it unset ({unset}), rank 1 has {value}" in row["error"], row
    assert rows[0] == rows[1]


def test_the_staged_handlers_take_the_attributes_of_the_kinds_table():
    # jaxddp/_native/kinds.py defines each collective kind once; the compiled handlers
    # (staged.cc) say what each binding takes, and a build that disagrees is not used
    import ctypes

    from jaxddp._native import build, staged
    from jaxddp._native.kinds import KINDS

    library = ctypes.CDLL(str(build()))
    # every kind has a staged handler but the CPU's own narrow allreduce
    assert tuple(k for k in KINDS if k != "narrow_allreduce") == staged.KINDS
    assert staged.disagreement(library) is None
    for kind, row in KINDS.items():
        assert library.jaxddp_native_configure(row.mpi_function.encode(), None) == 1, kind
        if row.staged:
            assert staged.attributes(library, kind) == list(row.handler_attributes()), kind
    assert library.jaxddp_narrow_allreduce  # the narrow allreduce's handler is in the build


def test_a_kind_whose_handler_disagrees_with_the_table_is_named():
    import ctypes
    import dataclasses

    from jaxddp._native import build, staged
    from jaxddp._native.kinds import KINDS

    library = ctypes.CDLL(str(build()))
    rows = dict(KINDS, reduce=dataclasses.replace(KINDS["reduce"], attributes=("comm", "root")))
    problem = staged.disagreement(library, rows)
    assert problem is not None
    assert problem.startswith("its reduce handler takes the attributes comm,dtype,nitems,op,root")
    assert problem.endswith("kinds.py says comm,root")
    unknown = dataclasses.replace(KINDS["bcast"], kind="scan")
    assert "its scan handler takes the attributes (none)" in str(
        staged.disagreement(library, {"scan": unknown})
    )
