"""The import graph of imgret's packages, read from the source (ast), every import counted
(function-local ones included).

    python tools/import_graph.py               # package -> packages it imports, module cycles
    python tools/import_graph.py --root OTHER  # the same for another checkout (e.g. an old
                                               # commit's `git worktree`): before and after

``tests/unit/test_layering.py`` enforces the same graph.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The layers: "core" is imgret's top-level modules (settings, decoding, the Embedder, metrics);
# the others are its subpackages imgret.training, imgret.gallery, imgret.service, imgret.cli.
PACKAGES = ("core", "training", "gallery", "service", "cli")
SUBPACKAGES = frozenset(PACKAGES[1:]) | {"migrations"}


def layer(module: str) -> str | None:
    """The layer of a dotted module name (``imgret.gallery.storage.db`` -> ``gallery``,
    ``imgret.settings`` -> ``core``); ``None`` for anything not imgret's."""
    parts = module.split(".")
    if parts[0] != "imgret":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else "core"


def package_dir(root: Path, package: str) -> Path:
    return root / "imgret" if package == "core" else root / "imgret" / package


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the layers (migrations excluded): dotted name -> file."""
    found = {}
    for path in sorted((root / "imgret").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if layer(name) in PACKAGES:
            found[name] = path
    return found


def imported(path: Path) -> set[str]:
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


def module_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports."""
    return {name: {dep for dep in imported(path) if dep in found and dep != name}
            for name, path in found.items()}


def package_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Package -> the other packages it imports."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in found.items():
        package = layer(name)
        graph[package].update(layer(dep) for dep in imported(path)
                              if layer(dep) in PACKAGES and layer(dep) != package)
    return {package: graph.get(package, set()) for package in PACKAGES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more nodes that reach each other (Tarjan), sorted."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="checkout to read (default: this one)")
    found = modules(parser.parse_args(argv).root)
    for package, deps in package_graph(found).items():
        print(f"{package:<9} -> {', '.join(sorted(deps)) or '(nothing of ours)'}")
    found_cycles = cycles(module_graph(found))
    print(f"module cycles: {found_cycles or 'none'}")
    return 1 if found_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
