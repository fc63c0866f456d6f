"""The package boundaries, enforced by reading imports (ast), every file and
every import (function-local ones included), with no exemption:

    core  <-  training
    core  <-  gallery  <-  service
    cli on top of all of them (and imported by none)

where core is imgret's top-level modules and the others its subpackages (imgret.gallery, ...)

and no import cycle between any two modules of these packages; the tests import no benchmark code
(the benchmarks may use the tests' support code: the live-server harness lives there).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import import_graph

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = import_graph.PACKAGES
# package -> packages it must not import, anywhere in any of its files.
FORBIDDEN = {
    "core": {"training", "gallery", "service", "cli"},
    "training": {"gallery", "service", "cli"},
    "gallery": {"training", "service", "cli"},
    "service": {"training", "cli"},
    "cli": set(),
}


def _imported(path: Path) -> set[str]:
    return import_graph.imported(path)


MODULES = import_graph.modules(ROOT)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_respect_layers(package: str) -> None:
    files = [path for name, path in MODULES.items() if import_graph.layer(name) == package]
    assert files
    for path in files:
        bad = {import_graph.layer(name) for name in _imported(path)} & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_tests_import_no_benchmark_code() -> None:
    for path in sorted((ROOT / "tests").rglob("*.py")):
        assert "benchmarks" not in {name.split(".")[0] for name in _imported(path)}, \
            f"{path.relative_to(ROOT)} imports benchmark code"


def test_benchmarks_import_only_the_tests_support_code() -> None:
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        tests = {name for name in _imported(path) if name.split(".")[0] == "tests"}
        assert all(name.startswith("tests.support") for name in tests), \
            f"{path.relative_to(ROOT)} imports {sorted(tests)}"


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
    return import_graph.cycles(graph)


@pytest.mark.parametrize("path",
                         sorted((ROOT / "imgret" / "service" / "routers").glob("[!_]*.py")),
                         ids=lambda path: path.stem)
def test_routers_only_translate_http(path: Path) -> None:
    """A router imports no other router and writes no SQL: the work is a service module's
    (``imgret.service.gallery``, ``imgret.service.version_evaluation``), the SQL
    ``imgret.gallery.storage``'s and ``version_store``'s (a router may name a table's type or a
    constant)."""
    names = _imported(path)
    routers = {name for name in names if name.startswith("imgret.service.routers.")}
    sql_modules = ("imgret.gallery.storage.", "imgret.gallery.versions.version_store")
    sql = {name for name in names
           if name.split(".")[0] == "sqlalchemy"
           or (name.startswith(sql_modules)
               and not name.startswith("imgret.gallery.storage.tables"))}
    assert not routers, f"{path.name} imports routers {sorted(routers)}"
    assert not sql, f"{path.name} imports {sorted(sql)}"
