"""The CLI starts fast (no heavy imports for --help) and lists the documented commands."""

from __future__ import annotations

import subprocess
import sys


def test_help_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys, imgret.cli.main\n"
        "heavy = [m for m in ('torch', 'faiss', 'fastapi', 'sqlalchemy') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_help_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from imgret.cli.main import main; main()", "--help"],
        capture_output=True, text=True,
    )
    assert out.returncode == 0
    for command in ("db", "index"):
        assert command in out.stdout


def test_train_benchmark_and_tune_share_the_base_options_read_from_train_config() -> None:
    import typer.main

    from imgret.cli.main import app
    from imgret.cli.train import BASE_OPTIONS, TRAIN_OPTION_CHANGES
    from imgret.training.config import TrainConfig

    group = typer.main.get_command(app)
    base = {}
    for name in ("train", "benchmark", "tune"):
        params = group.commands[name].params  # type: ignore[attr-defined]
        base[name] = [(p.name, p.opts, p.default, p.help) for p in params
                      if getattr(p, "rich_help_panel", None)]
    assert base["benchmark"] == base["tune"]
    assert [name for name, *_ in base["train"]] == list(BASE_OPTIONS)
    # The train command has its own defaults (and help) for a few of them, nothing else.
    assert [row[:2] for row in base["train"]] == [row[:2] for row in base["benchmark"]]
    assert {row[0] for row in base["train"]} - {
        row[0] for row, other in zip(base["train"], base["benchmark"], strict=True)
        if row != other} == set(BASE_OPTIONS) - set(TRAIN_OPTION_CHANGES)
    fields = TrainConfig.__pydantic_fields__
    for name, _flags, default, help_text in base["benchmark"]:
        if name in ("data", "image_size"):  # required on the CLI / defaulted by data set
            continue
        assert default == fields[name].default, name
        assert help_text == fields[name].description, name
    assert ("time_budget_s", ["--time-budget"]) in [(n, o) for n, o, *_ in base["train"]]


def test_a_bad_option_is_one_line_without_traceback(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from imgret.cli.main import main; main()", "train", "--data", "x",
         "--out", str(tmp_path / "run"), "--loss", "triplet", "--epochs", "0"],
        capture_output=True, text=True,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "error: bad TrainConfig: epochs: Input should be greater than or equal to 1" in (
        out.stderr)
    assert not (tmp_path / "run").exists()
