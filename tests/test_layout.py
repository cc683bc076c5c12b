"""The package's layout: imports flow one way, in no circle, modules stay short.

Every import of every module of ``jaxddp/`` is read with :mod:`ast` (also those inside
functions and under ``TYPE_CHECKING``: a late import is still a dependency), relative imports
resolved, and the layers checked, from the bottom::

    _base, _types <- _native <- _runtime <- _collectives/_jax <- _collectives
        <- _training, _data (neither imports the other) <- the public modules and the CLI

Nothing is imported or launched. The checks prove themselves on small packages made in
``tmp_path`` that break each rule.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "jaxddp"
MAX_LINES = 400

# (prefix of a module's name inside the package, layer, group): a module may import from its
# own layer (its group's, when the layer has groups) and from the layers below
LAYERS = (
    ("_base", 0, ""),
    ("_types", 0, ""),
    ("_native", 1, ""),
    ("_runtime", 2, ""),
    ("_collectives._jax", 3, ""),
    ("_collectives", 4, ""),
    ("_training", 5, "training"),
    ("_data", 5, "data"),
)
PUBLIC = (6, "")  # jaxddp/__init__.py, grain.py, torch.py, __main__.py, _cli.py, examples/


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. "jaxddp._collectives.api"
    target: str  # the imported module (a submodule where one is named)
    line: int
    private: tuple[str, ...]  # private names taken from the target (`from m import _x`, `m._x`)

    def __str__(self) -> str:
        taken = f" (takes {', '.join(self.private)})" if self.private else ""
        return f"{self.source}:{self.line} imports {self.target}{taken}"


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root`` by its dotted name (a package by its folder's)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str, found: dict[str, Path]) -> bool:
    return found[name].name == "__init__.py"


def _resolve(node: ast.ImportFrom, source: str, found: dict[str, Path]) -> str:
    if not node.level:
        return node.module or ""
    package = source if _is_package(source, found) else source.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _module_imports(
    source: str, tree: ast.Module, found: dict[str, Path]
) -> tuple[list[tuple[str, int, list[str]]], dict[str, str]]:
    """The imports of one module (target, line, private names taken), and the local names
    bound to modules of the package."""
    bound: dict[str, str] = {}
    edges: list[tuple[str, int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in found:
                    edges.append((alias.name, node.lineno, []))
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, source, found)
            plain: list[str] = []
            for alias in node.names:
                if f"{module}.{alias.name}" in found:  # a submodule
                    edges.append((f"{module}.{alias.name}", node.lineno, []))
                    bound[alias.asname or alias.name] = f"{module}.{alias.name}"
                else:
                    plain.append(alias.name)
            if plain and module in found:
                edges.append((module, node.lineno, [n for n in plain if _private(n)]))
    return edges, bound


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def imports(root: Path) -> list[Import]:
    """Every import of a module of the package by a module of the package."""
    found = modules(root)
    result = []
    for source, path in found.items():
        tree = ast.parse(path.read_text(), str(path))
        edges, bound = _module_imports(source, tree, found)
        attributes: dict[str, list[str]] = {}  # `module._name` in this file
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and _private(node.attr)
            ):
                attributes.setdefault(bound[node.value.id], []).append(node.attr)
        for target, line, private in edges:
            taken = tuple(sorted({*private, *attributes.pop(target, [])}))
            result.append(Import(source, target, line, taken))
    return result


def layer(name: str) -> tuple[int, str]:
    inner = name.partition(".")[2]
    for prefix, level, group in LAYERS:
        if inner == prefix or inner.startswith(prefix + "."):
            return level, group
    return PUBLIC


def folder(name: str, found: dict[str, Path]) -> str:
    return name if _is_package(name, found) else name.rpartition(".")[0]


def cycles(edges: list[Import]) -> list[list[str]]:
    """The import cycles: each strongly connected group of modules (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in sorted(graph[node]):
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph[node]:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def against_the_direction(edges: list[Import]) -> list[str]:
    wrong = []
    for edge in edges:
        (mine, my_group), (theirs, their_group) = layer(edge.source), layer(edge.target)
        if theirs > mine or (theirs == mine and my_group != their_group):
            wrong.append(str(edge))
    return wrong


def private_crossings(root: Path, edges: list[Import]) -> list[str]:
    found = modules(root)
    return [
        str(edge)
        for edge in edges
        if edge.private and folder(edge.source, found) != folder(edge.target, found)
    ]


def long_modules(root: Path) -> list[str]:
    return [
        f"{name}: {length} lines"
        for name, path in modules(root).items()
        if (length := len(path.read_text().splitlines())) > MAX_LINES
    ]


# -- jaxddp itself ---------------------------------------------------------------------------


def test_no_import_cycle_counting_imports_inside_functions():
    assert cycles(imports(PACKAGE)) == []


def test_imports_flow_from_the_public_modules_down_to_the_base():
    assert against_the_direction(imports(PACKAGE)) == []


def test_no_private_name_is_imported_from_another_folder():
    assert private_crossings(PACKAGE, imports(PACKAGE)) == []


def test_no_module_is_over_400_lines():
    assert long_modules(PACKAGE) == []


def test_the_walk_sees_the_whole_package():
    edges = imports(PACKAGE)
    sources = {edge.source for edge in edges}
    # a late import (inside a function) and a TYPE_CHECKING import are both seen
    assert "jaxddp._runtime.world" in sources
    assert any(edge.target == "jaxddp._training.batchnorm" for edge in edges)
    assert len(modules(PACKAGE)) > 40


# -- the checks, on packages that break them -------------------------------------------------


def make_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "jaxddp"
    for name, text in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(package).parents:
            (package / parent / "__init__.py").touch()
        path.write_text(text)
    return package


def test_a_cycle_through_a_late_import_is_found(tmp_path):
    package = make_package(
        tmp_path,
        {
            "_collectives/_jax/primitives.py": "from . import restage\n",
            "_collectives/_jax/restage.py": "def f():\n    from .primitives import p\n",
            "_collectives/_jax/lowering.py": "from .primitives import p\n",
        },
    )
    assert cycles(imports(package)) == [
        ["jaxddp._collectives._jax.primitives", "jaxddp._collectives._jax.restage"]
    ]


def test_an_import_against_the_direction_is_found(tmp_path):
    package = make_package(
        tmp_path,
        {
            "_base/settings.py": "import typing\nif typing.TYPE_CHECKING:\n"
            "    from .._runtime import world\n",
            "_runtime/world.py": "from .._base import settings\n",
            "_collectives/_jax/lowering.py": "def f():\n    from ..api import allreduce\n",
            "_collectives/api.py": "from ._jax.lowering import emit\n",
            "_data/sampler.py": "from .._training.gradients import g\n",
            "_training/gradients.py": "from .. import _collectives\nfrom ..grain import b\n",
            "grain.py": "from ._data.sampler import s\n",
        },
    )
    assert sorted(against_the_direction(imports(package))) == [
        "jaxddp._base.settings:3 imports jaxddp._runtime.world",
        "jaxddp._collectives._jax.lowering:2 imports jaxddp._collectives.api",
        "jaxddp._data.sampler:1 imports jaxddp._training.gradients",
        "jaxddp._training.gradients:2 imports jaxddp.grain",
    ]


def test_a_private_name_from_another_folder_is_found(tmp_path):
    package = make_package(
        tmp_path,
        {
            "_collectives/api.py": "def _channels(): ...\ndef _ok(): ...\n",
            "_collectives/host.py": "from .api import _channels\n",
            "_training/metrics.py": "from .._collectives.api import _channels, reduce_all\n",
            "_training/state.py": "from .._collectives import api as comm\n"
            "def f():\n    return comm._ok()\n",
        },
    )
    assert sorted(private_crossings(package, imports(package))) == [
        "jaxddp._training.metrics:1 imports jaxddp._collectives.api (takes _channels)",
        "jaxddp._training.state:1 imports jaxddp._collectives.api (takes _ok)",
    ]


def test_a_long_module_is_found(tmp_path):
    package = make_package(tmp_path, {"_data/sampler.py": "x = 1\n" * (MAX_LINES + 1)})
    assert long_modules(package) == [f"jaxddp._data.sampler: {MAX_LINES + 1} lines"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("jaxddp._base.settings", (0, "")),
        ("jaxddp._collectives._jax.compat", (3, "")),
        ("jaxddp._collectives.api", (4, "")),
        ("jaxddp._data.loaders.grain", (5, "data")),
        ("jaxddp._cli", PUBLIC),
        ("jaxddp", PUBLIC),
    ],
)
def test_layers(name, expected):
    assert layer(name) == expected
