"""The wheel: everything under the one ``imgret`` namespace (installing it claims no other
top-level name), with the files the code reads at run time (migrations, the web page)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_wheel_holds_one_namespace_with_its_data_files(tmp_path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("imgret-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(
        (".dist-info", ".data"))}
    assert top == {"imgret"}
    migrations = sorted(p.name for p in (REPO / "imgret/migrations/versions").glob("0*.py"))
    static = sorted(p.name for p in (REPO / "imgret/service/static").iterdir())
    assert migrations and static
    for wanted in ("imgret/migrations/env.py", "imgret/migrations/script.py.mako",
                   *(f"imgret/migrations/versions/{name}" for name in migrations),
                   *(f"imgret/service/static/{name}" for name in static)):
        assert wanted in names, wanted
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "imgret = imgret.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()
