"""The package boundaries of the contract, enforced by reading imports (ast), every file and
every import (function-local ones included), with no exemption:

    imgret  <-  training
    imgret  <-  index  <-  service
    cli on top of all of them (and imported by none)

and no import cycle between any two modules of these packages; benchmarks import no test code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("imgret", "training", "index", "service", "cli")
# package -> packages it must not import, anywhere in any of its files.
FORBIDDEN = {
    "imgret": {"training", "index", "service", "cli"},
    "training": {"index", "service", "cli"},
    "index": {"training", "service", "cli"},
    "service": {"training", "cli"},
    "cli": set(),
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imported(path: Path) -> set[str]:
    """Every absolute import of a file: ``a.b`` for ``import a.b``; ``a.b`` and ``a.b.c`` for
    ``from a.b import c`` (``c`` may be a module or a name)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


MODULES = _modules()


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_respect_layers(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = {name.split(".")[0] for name in _imported(path)} & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_benchmarks_import_no_test_code() -> None:
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        assert "tests" not in {name.split(".")[0] for name in _imported(path)}, \
            f"{path.relative_to(ROOT)} imports test code"


def test_no_import_cycles_between_modules() -> None:
    graph = {name: {dep for dep in _imported(path) if dep in MODULES and dep != name}
             for name, path in MODULES.items()}
    cycles = _strongly_connected(graph)
    assert cycles == [], f"import cycles: {cycles}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]
    ]


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that import each other (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)
