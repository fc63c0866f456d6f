"""The CLI starts fast (no heavy imports for --help) and lists the contract's commands."""

from __future__ import annotations

import subprocess
import sys


def test_help_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys, cli.main\n"
        "heavy = [m for m in ('torch', 'faiss', 'fastapi', 'sqlalchemy') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_help_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", "--help"],
        capture_output=True, text=True,
    )
    assert out.returncode == 0
    for command in ("db", "index"):
        assert command in out.stdout
