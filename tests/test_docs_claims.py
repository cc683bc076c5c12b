"""What the docs state as fact stays equal to what the code and the examples do: the count of
deadlocks above the home page's table, the default of `background`, the digits example's
accuracy, the home page's cost figures (the benchmarks page's), the errors page's messages
(the code's), and public names where the docs name an exception."""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path

import pytest

import jaxddp
from jaxddp._training.checkpoint import steps
from tests.harness import fresh_python

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _table_rows(text: str, heading: str) -> list[str]:
    """The body rows of the first table after ``heading``."""
    after = text[text.index(heading) :]
    lines = [line for line in after.splitlines() if line.startswith("|")]
    start = after.splitlines().index(lines[0])
    rows = []
    for line in after.splitlines()[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows[2:]  # less the header and its rule


def _stated_count(text: str) -> int:
    match = re.search(r"without the (\w+) classic deadlocks", text)
    assert match, "no 'without the N classic deadlocks'"
    return NUMBERS[match.group(1)]


def test_the_deadlocks_counted_are_the_rows_of_the_home_pages_table():
    home = _read(DOCS / "index.md")
    rows = _table_rows(home, "## What goes wrong in data-parallel training")
    assert _stated_count(home) == len(rows) == 4
    assert _stated_count(_read(README)) == len(rows)
    assert "three classic deadlocks" not in _read(DOCS / "comparison.md")


def test_background_is_the_default_as_the_checkpoints_page_says():
    default = inspect.signature(jaxddp.CheckpointManager).parameters["background"].default
    page = _read(DOCS / "checkpoints.md")
    assert default is True
    assert "Background is the default" in page
    assert "`jaxddp.CheckpointManager(directory, background=False)`" in page


def _figures(row: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ms", row)


@pytest.mark.parametrize("page", [DOCS / "index.md", README], ids=["home", "readme"])
def test_the_first_screens_costs_are_the_benchmarks_pages(page):
    rows = _table_rows(_read(page), "What gradient sync adds to a train step")
    bench = _read(DOCS / "benchmarks" / "index.md")
    by_tool = {row.split("|")[1].strip(): _figures(row) for row in rows}
    assert set(by_tool) == {
        "jaxddp (jax 0.12)",
        "PyTorch DDP (gloo)",
        "JAX's own `jax.distributed` (gloo)",
    }
    assert all(len(figures) == 3 for figures in by_tool.values()), by_tool
    step = _table_rows(bench, "## What sync adds to a train step")
    jax_own = _table_rows(bench, "## Against JAX's own multi-process path")
    assert by_tool["jaxddp (jax 0.12)"] == [_figures(r)[1] for r in step]
    assert by_tool["PyTorch DDP (gloo)"] == [_figures(r)[2] for r in step]
    assert by_tool["JAX's own `jax.distributed` (gloo)"] == [_figures(r)[0] for r in jax_own]


def test_the_xla_pages_costs_are_the_all_results_pages():
    """docs/xla.md's table repeats the run that benchmarks/run.py wrote on the All results
    page: the same milliseconds and ratios, row by row (the page orders its columns for
    reading: model and ranks first)."""

    def by_row(rows: list[str], model: int, ranks: int) -> dict:
        cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
        return {
            (c[model], c[ranks]): (_figures(row)[:4], re.findall(r"\d+\.\d+x", row))
            for c, row in zip(cells, rows, strict=True)
        }

    page = _table_rows(_read(DOCS / "xla.md"), "## What it costs on a CPU")
    results = _table_rows(_read(DOCS / "benchmarks" / "results.md"), "## JAX's own collectives")
    mine, theirs = by_row(page, 0, 1), by_row(results, 2, 0)
    assert len(mine) == 6
    assert mine == theirs


def test_the_errors_page_quotes_the_missing_orbax_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # as if not installed
    with pytest.raises(ImportError) as info:
        steps.require_orbax()
    assert f'`ImportError`: "{info.value}"' in _read(DOCS / "errors.md")


def test_the_errors_pages_gpu_messages_are_the_codes():
    sources = "".join(
        _read(ROOT / "jaxddp" / p)
        for p in ("_collectives/_jax/lowering.py", "_native/staged.cc", "_native/allreduce.cc")
    )
    code = re.sub(r'"\s*\n\s*(?:f?")', "", sources)  # adjacent string literals joined
    for phrase in (
        "cannot run in a program for a GPU here: jaxddp's GPU handlers are not in use (",
        (
            "and mpi4jax has no CUDA extension. Turn JAXDDP_NATIVE_ALLREDUCE on and give jaxddp "
            "a C++ compiler (`CXX`; `jaxddp doctor` says why they are not in use), or build "
            "mpi4jax with CUDA (`CUDA_ROOT` set to the CUDA toolkit, see the docs' GPUs page)."
        ),
        " failed with CUDA error ",
        "jaxddp's GPU collectives were called before jaxddp configured them",
        " elements per rank is more than one MPI call takes (2**31 - 1)",
    ):
        assert phrase in code, phrase
        assert phrase in _read(DOCS / "errors.md"), phrase


def test_the_docs_name_exceptions_users_can_import():
    assert "SettingError" in jaxddp.__all__
    for page in [*DOCS.glob("*.md"), README]:
        assert "jaxddp._base" not in _read(page), page.name
    assert "`jaxddp.SettingError`" in _read(DOCS / "errors.md")


def _accuracy(text: str) -> str:
    match = re.search(r"test accuracy: ([\d.]+%)", text)
    assert match, text
    return match.group(1)


@pytest.mark.slow
def test_the_digits_accuracy_the_docs_state_is_what_the_example_prints():
    """One process with the global batch of the 2-rank demo (about 4 s): the figure
    getting-started and the README state for both; that 2 ranks reach the same accuracy
    as one process is tests/test_examples.py's (4 epochs, under mpiexec)."""
    done = fresh_python(
        ["-m", "jaxddp.examples.digits", "--batch-size", "64"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    printed = _accuracy(done.stdout)
    assert f"run reaches {printed} test accuracy" in _read(DOCS / "getting-started.md")
    assert f"accuracy ({printed} after the default 20 epochs" in _read(README)


@pytest.mark.parametrize("page", [DOCS / "index.md", README], ids=["home", "readme"])
def test_an_install_without_build_isolation_installs_jax_first(page):
    """mpi4jax's build imports `jax.ffi` for its headers: built with
    `--no-build-isolation`, it fails unless jax was installed before it."""
    blocks = re.findall(r"```bash\n(.*?)```", _read(page), re.DOTALL)
    builds = [b for b in blocks if "--no-build-isolation" in b and "mpi4jax" in b]
    assert builds
    for block in builds:
        before = block[: block.index("mpi4jax")]
        assert re.search(r"pip install (?:\S+ )*jax\b", before), block
