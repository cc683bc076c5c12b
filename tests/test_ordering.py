"""Every rank must start its collectives in the same order, or a job deadlocks.

Inside one jitted step that order is XLA's to choose: its CPU runtime runs thunks as soon as
what they wait for is done, on several threads. At the jit's own level jaxddp's MPI calls
carry no JAX effect (so the step keeps JAX's fast dispatch path) and are chained by an XLA
token that each call takes from the one before; inside control flow they carry mpi4jax's
ordered effect, whose token continues that chain. This test reads the execution graph
XLA:CPU actually built (its own debug log) and checks that the collectives of a step form
one chain, through a ``lax.cond`` too, and through a jitted function replayed into its
caller. It depends on that log's format: if a jaxlib upgrade
changes it, the parsing fails loudly here, and the ordering needs checking again before the
new release joins ``jaxddp._collectives._jax.compat.VERIFIED``.
"""

import itertools
import os
import re
from pathlib import Path

import jax
import pytest

from jaxddp._collectives._jax import path as _path
from tests.harness import launch

SCRIPTS = Path(__file__).with_name("scripts")
THUNK = re.compile(r"thunk #(\d+): op_name=(\S+), kind=(\S+), dependencies=\[([^\]]*)\]")


def execution_graphs(log: str) -> list[dict[str, tuple[int, str, set[str]]]]:
    """Each graph in the log: op name -> (thunk index, kind, names it waits for)."""
    graphs: list[dict[str, tuple[int, str, set[str]]]] = []
    for line in log.splitlines():
        if line.startswith("ThunkExecutor: #thunks="):
            graphs.append({})
        elif graphs and (m := THUNK.search(line)):
            index, name, kind, deps = m.groups()
            waits = {d.strip() for d in deps.split(",") if d.strip()}
            graphs[-1][name] = (int(index), kind, waits)
    return graphs


def is_collective(name: str, kind: str) -> bool:
    return kind == "custom-call" and re.match(COLLECTIVE, name) is not None


COLLECTIVE = r"(\w+_mpi|jaxddp_chained|jaxddp_ordered)\.\d+$"


def reaches(graph: dict[str, tuple[int, str, set[str]]], later: str, earlier: str) -> bool:
    """Whether ``later`` waits, directly or not, for ``earlier``."""
    seen, todo = set(), [later]
    while todo:
        for dep in graph[todo.pop()][2]:
            if dep == earlier:
                return True
            if dep not in seen and dep in graph:
                seen.add(dep)
                todo.append(dep)
    return False


def ordered_nodes(graph: dict[str, tuple[int, str, set[str]]]) -> list[str]:
    """The graph's MPI calls and conditionals, in the order XLA scheduled them."""
    return [
        name
        for _, name in sorted(
            (index, name)
            for name, (index, kind, _) in graph.items()
            if is_collective(name, kind) or kind == "conditional"
        )
    ]


def unordered(graph: dict[str, tuple[int, str, set[str]]]) -> list[tuple[str, str]]:
    """Each (earlier, later) pair of consecutive ordered nodes where later need not wait."""
    names = ordered_nodes(graph)
    return [(a, b) for a, b in itertools.pairwise(names) if not reaches(graph, b, a)]


def test_the_check_sees_two_collectives_that_need_not_wait_for_each_other():
    log = """ThunkExecutor: #thunks=4 #source_nodes=2 #sink_nodes=2
 thunk #00000: op_name=fusion, kind=kernel, dependencies=[], source=true, sink=false, priority=1
 thunk #00001: op_name=allreduce_mpi.3, kind=custom-call, dependencies=[fusion], source=false
 thunk #00002: op_name=allreduce_mpi.6, kind=custom-call, dependencies=[fusion], source=false
 thunk #00003: op_name=bcast_mpi.9, kind=custom-call, dependencies=[allreduce_mpi.6], source=f
"""
    (graph,) = execution_graphs(log)
    assert ordered_nodes(graph) == ["allreduce_mpi.3", "allreduce_mpi.6", "bcast_mpi.9"]
    assert unordered(graph) == [("allreduce_mpi.3", "allreduce_mpi.6")]


def test_this_jaxlib_takes_the_fast_path():
    assert jax.default_backend() == "cpu"
    assert _path.fast_path(), (
        f"jax {jax.__version__}: {_path.path_reason()[1]}, so every collective "
        "takes the ordered-effect path. Check the ordering tests (tests/test_ordering.py, "
        "tests/mpi/test_ordering.py) against it, then add it to "
        "jaxddp._collectives._jax.compat.VERIFIED."
    )


def assert_one_chain_without_effect(graphs: list[dict], count: int) -> None:
    """The graph with ``count`` MPI calls and no conditional chains them all, chained form."""
    found = [
        g
        for g in graphs
        if sum(is_collective(n, k) for n, (_, k, _) in g.items()) == count
        and not any(k == "conditional" for _, k, _ in g.values())
    ]
    assert found, [ordered_nodes(g) for g in graphs]
    names = ordered_nodes(found[0])
    assert all(n.startswith("jaxddp_chained.") for n in names), names
    assert unordered(found[0]) == [], names


@pytest.mark.slow  # a real launch
def test_the_collectives_of_a_step_form_one_chain_in_xlas_execution_graph():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="thunk_executor=6")
    # XLA logs the graphs as it compiles: a program from the suite's compilation cache would
    # log nothing
    result = launch([str(SCRIPTS / "thunk_graph.py")], 2, timeout=120, env=env, compile_cache=False)
    assert result.ok, result.report()
    log = result.rank_logs["0"]
    assert "step done" in log
    graphs = execution_graphs(log)
    assert graphs, "no execution graph in the log: has XLA:CPU's debug log format changed?"
    # the flat step: all seven calls chained, with no JAX effect, in one chain; and a jitted
    # function called on its own first, then inside another jit: one chain of four; a
    # shard_optimizer update: its alltoalls, allreduce and allgathers in one chain of five
    for count in (7, 4, 5):
        assert_one_chain_without_effect(graphs, count)
    # the step with the cond
    step = max(graphs, key=lambda g: sum(k == "conditional" for _, k, _ in g.values()))
    names = ordered_nodes(step)
    # the mean: 3 big leaves alone, one float32 bucket (bfloat16 is reduced in float32) and
    # one int32 bucket; then the cond, the broadcast and the max
    assert sum(is_collective(n, step[n][1]) for n in names) == 7, names
    assert sum(step[n][1] == "conditional" for n in names) == 1, names
    assert unordered(step) == [], names
    # chained up to the cond, mpi4jax's ordered effect from there on
    kinds = [n.split(".")[0] for n in names]
    assert kinds[0] == "jaxddp_chained", names
    assert kinds[-1] == "jaxddp_ordered", names
    # and the cond's own graph holds its reduction
    assert any(
        len(g) < len(step) and any(is_collective(n, k) for n, (_, k, _) in g.items())
        for g in graphs
    )


@pytest.mark.slow  # a real launch
def test_a_program_that_exits_without_waiting_for_its_step_ends_cleanly():
    result = launch([str(SCRIPTS / "exit_without_waiting.py")], 2, timeout=120)
    assert result.ok, result.report()
    assert all("dispatched" in log for log in result.rank_logs.values())
