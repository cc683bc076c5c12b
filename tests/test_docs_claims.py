"""What the docs state as fact stays equal to what the code and the examples do: the count of
deadlocks above the home page's table, the default of `background`, the digits example's
accuracy, the home page's cost figures (the benchmarks page's), the errors page's messages
(the code's), and public names where the docs name an exception."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import sys
import tomllib
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


@pytest.mark.parametrize(
    "page", [DOCS / "index.md", README, DOCS / "benchmarks" / "index.md"],
    ids=["home", "readme", "benchmarks"],
)  # fmt: skip
def test_the_headline_table_is_the_saved_runs(page):
    """The README's, the home page's and the Benchmarks page's comparison with PyTorch DDP and
    JAX's own program is what benchmarks/bench_headline.py printed for the run it saved (its
    rows name the versions measured), and the README's prose quotes it."""
    from benchmarks.headline_table import table

    run = json.loads((ROOT / "benchmarks" / "results" / "headline-np2.json").read_text())
    assert table(run) in _read(page)
    readme = " ".join(_read(README).split())
    step = run["rows"][0]["step_s"]  # the 20-leaf model, which the prose quotes
    assert f"added {(step['jaxddp'] - step['jax_alone']) * 1e3:.2f} ms" in readme
    assert f"added {(step['torch_ddp'] - step['torch_alone']) * 1e3:.2f} ms" in readme


def test_the_compression_pages_costs_are_the_saved_run():
    """docs/compression.md shows what benchmarks/bench_compression.py printed for the run it
    saved, and its prose quotes that run's 1 Gbit/s ratios against the issue's targets."""
    from benchmarks.bench_compression import table

    run = json.loads((ROOT / "benchmarks" / "results" / "compression-np2.json").read_text())
    page = _read(DOCS / "compression.md")
    assert table(run["results"], run["np"], run["repeats"]) in page
    assert f"jax {run['jax']}" in page
    assert f"({run['date']};" in page
    sync = run["results"]["1gbit"]["25M"]["sync"]
    prose = " ".join(page.split())
    assert f"bf16 takes **{sync['bf16'] / sync['full']:.2f}x**" in prose
    assert f"PowerSGD rank 4 **{sync['psgd4'] / sync['full']:.2f}x**" in prose


def test_the_xla_pages_costs_are_the_all_results_pages():
    """docs/xla.md's tables repeat the run that benchmarks/run.py wrote on the All results
    page: the same milliseconds and ratios, row by row (the page orders its columns for
    reading: model or leaves, then ranks)."""

    def by_row(rows: list[str], name: int, ranks: int) -> dict:
        cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
        return {
            (c[name], c[ranks]): (_figures(row)[-5:], re.findall(r"\d+\.\d+x", row))
            for c, row in zip(cells, rows, strict=True)
        }

    page = _read(DOCS / "xla.md").split("## What it costs on a CPU")[1]
    results = _read(DOCS / "benchmarks" / "results.md").split("## JAX's own collectives")[1]
    dispatch_page, training_page = _table_rows(page, "Dispatch"), _table_rows(page, "Training")
    dispatch, training = _table_rows(results, "Dispatch"), _table_rows(results, "| ranks")
    assert len(training_page) == 6
    assert len(dispatch_page) == 6
    assert by_row(training_page, 0, 1) == by_row(training, 2, 0)
    assert by_row(dispatch_page, 0, 1) == by_row(dispatch, 2, 0)


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


INSTALL = DOCS / "install.md"
# what only the install page may hold a command to install: the stack and jaxddp itself
INSTALLS_STACK = re.compile(
    r"pip install\b[^\n#`&)]*?(?:jaxddp|mpi4jax|mpi4py|mpich|nanobind|\bjax\b)", re.IGNORECASE
)
# The errors page quotes the checkpoint code's ImportError, whose hint is still the extra's
# (jaxddp/_training/checkpoint/steps.py is another branch's: the message changes there).
QUOTED_HINTS = {"docs/errors.md": ['pip install "jaxddp']}


def _install_recipes() -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    try:
        from install_docs import recipes
    finally:
        sys.path.pop(0)
    return recipes(_read(INSTALL))


def _pyproject() -> dict:
    return tomllib.loads(_read(ROOT / "pyproject.toml"))


def _noxfile_constants() -> dict[str, object]:
    """The noxfile's literal constants (importing it needs nox, which the tests do not)."""
    tree = ast.parse(_read(ROOT / "noxfile.py"))
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    found[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    return found


def test_the_install_page_marks_both_recipes_and_states_mpi4jaxs_build_once():
    recipes = _install_recipes()
    assert set(recipes) == {"clone", "wheel"}
    builds = re.findall(r"pip install[^\n]*mpi4jax", _read(INSTALL))
    assert len(builds) == 1, builds  # one shared step
    for name, body in recipes.items():
        assert builds[0] in body, name
        before = body[: body.index(builds[0])]
        # mpi4jax's build without isolation imports jax.ffi: jax must come first
        assert re.search(r"pip install (?:\S+ )*\"?jax\b", before), name
        assert "CUDA_ROOT=" in before, name  # an nvcc wrapper on PATH must not fail it
        assert "mpiexec -n 2 python -m jaxddp.examples.digits" in body, name
    assert "not on the Python package index yet" in _read(INSTALL)


def test_only_the_install_page_holds_install_commands():
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    found = {
        str(page.relative_to(ROOT)): INSTALLS_STACK.findall(_read(page))
        for page in pages
        if page != INSTALL
    }
    assert {page: lines for page, lines in found.items() if lines} == QUOTED_HINTS


def test_the_install_pages_versions_are_pyprojects_and_the_noxfiles():
    rows = {
        row.split("|")[1].strip(): [cell.strip() for cell in row.split("|")[2:4]]
        for row in _table_rows(_read(INSTALL), "## Supported versions")
    }
    project = _pyproject()["project"]
    nox = _noxfile_constants()
    requires = {}
    for spec in project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]:
        name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0)
        requires[name] = spec[len(name) :]
    python, jax = rows.pop("Python"), rows.pop("jax, jaxlib")
    assert python == [f"`{project['requires-python']}`", ", ".join(nox["PYTHONS"])]
    assert jax[0] == f"`{requires['jax']}`" == f"`{nox['JAX_RANGE']}`"
    expected = ", ".join(
        f"{pin} (Python {', '.join(pythons)})" for pin, pythons in nox["JAX_MATRIX"].values()
    )
    assert jax[1] == expected
    for label, (bound, _) in rows.items():
        if label.startswith("MPI"):
            continue
        package = label.split()[0]
        assert bound == f"`{requires[package]}`", label
    assert rows["mpi4jax"][0] == f"`{nox['MPI4JAX'].removeprefix('mpi4jax')}`"
    ((torch_python, torch_pin),) = nox["TORCH_CPU"].items()
    assert rows["torch (`torch`)"][1].startswith(torch_pin.split("==")[1])
    assert f"Python {torch_python} only" in rows["torch (`torch`)"][1]
    described = {label.split()[0] for label in rows} | {"jax", "Python"}
    # test tools, the examples' own packages, the docs' Equinox example; mpich is the MPI row
    aside = {"chex", "pytest", "pytest-xdist", "hypothesis", "rich", "scikit-learn", "equinox"}
    assert set(requires) - aside - {"mpich"} <= described


def test_the_version_is_pyprojects_everywhere():
    version = _pyproject()["project"]["version"]
    assert jaxddp.__version__ == version
    done = fresh_python(["-m", "jaxddp", "--version"], env=dict(os.environ), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"jaxddp {version}"
    releases = re.findall(r"^## \[([^\]]+)\]", _read(ROOT / "CHANGELOG.md"), re.MULTILINE)
    assert releases[0] == version
    assert f"dist/jaxddp-{version}-py3-none-any.whl" in _read(INSTALL)


def test_a_rank_gets_a_batch_of_padding_only_exactly_where_the_readme_says():
    """README: a rank's last batch is only padding where `0 < N mod (W*B) < W`."""
    from jaxddp._data.shards import per_rank, rank_entries

    assert "(`0 < N mod (W*B) < W`)" in _read(README)
    for n in range(1, 40):
        for w in range(1, 5):
            for b in range(1, 5):
                last = -(-per_rank(n, w, False) // b) - 1
                masks = [
                    rank_entries(
                        n, w, r, last * b, (last + 1) * b,
                        seed=0, epoch=0, shuffle=False, drop_last=False,
                    )[1]
                    for r in range(w)
                ]  # fmt: skip
                assert any(not m.any() for m in masks) == (0 < n % (w * b) < w), (n, w, b)


def test_the_settings_page_names_the_test_switches_and_the_library_reads_none():
    from tests.harness.switches import SWITCHES

    page = _read(DOCS / "settings.md")
    for module, (attribute, variable, _) in SWITCHES.items():
        source = module.replace(".", "/") + ".py"
        assert f"- `{variable}` (sets `{attribute}` in `{source}`)" in page, variable
    read = set(re.findall(r"JAXDDP_TEST_\w+", "".join(
        _read(path) for path in (ROOT / "jaxddp").rglob("*.py")
    )))  # fmt: skip
    assert read == set()


def test_setting_errors_docstring_names_every_setting_the_ranks_must_share():
    from jaxddp._base.settings import AGREED

    doc = " ".join((jaxddp.SettingError.__doc__ or "").split())
    for setting in AGREED:
        assert f"``{setting.name}``" in doc, setting.name


def test_the_docs_recommend_no_mpi4jax_cuda_setting_that_jaxddp_overrides():
    for page in [README, *DOCS.rglob("*.md")]:
        assert not re.search(r"MPI4JAX_USE_CUDA_MPI=\d", _read(page)), page
