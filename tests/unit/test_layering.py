"""The package boundaries of STYLE.md §5, enforced by reading imports (ast)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package -> packages it must not import (at module level or anywhere).
FORBIDDEN = {
    "imgret": {"training", "index", "service"},
    "training": {"index", "service"},
    "index": {"training", "service"},
    "service": {"training"},
}


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_layers(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        # The CLI and its commands may reach every package, lazily inside commands.
        lazy_ok = package == "imgret" and (path.name == "cli.py" or "commands" in path.parts)
        bad = _imports(path, top_level_only=lazy_ok) & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
