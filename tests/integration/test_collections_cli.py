"""`imgret collections ...` and `--collection` on a real database (SQLite and PostgreSQL):
one image folder ingested into two collections stays two galleries, each evaluated and
deleted on its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from imgret.cli.main import app, hoist_collection


@pytest.fixture
def env(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI sets it from --collection; set here, it is restored after the test.
    monkeypatch.setenv("IMGRET_COLLECTION", "default")


def invoke(*args: str):
    import os

    from imgret.settings import get_settings

    # Each invocation is its own process in real use: settings read afresh, no --collection
    # left over from the one before.
    os.environ["IMGRET_COLLECTION"] = "default"
    get_settings.cache_clear()
    return CliRunner().invoke(app, hoist_collection(list(args)))


def run(*args: str) -> str:
    result = invoke(*args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def _listing() -> dict[str, int]:
    return {c["name"]: c["items"]
            for c in json.loads(run("collections", "list", "--json"))["collections"]}


def test_one_folder_in_two_collections_stays_two_galleries(env: None,
                                                           image_folder: Path) -> None:
    run("ingest", str(image_folder), "--no-progress")
    n = _listing()["default"]
    assert n > 0
    assert "created collection shop" in run("collections", "create", "shop")
    # The option may follow the command or precede it.
    run("ingest", str(image_folder), "--no-progress", "--collection", "shop")
    run("--collection=shop", "ingest", str(image_folder), "--query-set", "q", "--no-progress")
    assert _listing() == {"default": n, "shop": n}
    out = run("evaluate", "--query-set", "q", "--collection", "shop")
    assert "MAP@R" in out or "map_at_r" in out
    # The query set is the shop's alone.
    refused = invoke("evaluate", "--query-set", "q")
    assert refused.exit_code != 0 and "unknown query set" in str(refused.exception)
    unconfirmed = invoke("collections", "delete", "shop")
    assert unconfirmed.exit_code != 0 and _listing() == {"default": n, "shop": n}
    assert f"({n} items)" in run("collections", "delete", "shop", "--yes")
    assert _listing() == {"default": n}
    missing = invoke("--collection", "shop", "models", "list")
    assert missing.exit_code != 0 and "no collection named 'shop'" in str(missing.exception)


@pytest.mark.parametrize("args, expected", [
    (["ingest", "p", "--collection", "a"], ["--collection", "a", "ingest", "p"]),
    (["--collection=a", "serve"], ["--collection=a", "serve"]),
    (["ingest", "--collection"], ["ingest", "--collection"]),  # Click reports the gap
])
def test_the_collection_option_is_hoisted_before_the_command(args, expected) -> None:
    assert hoist_collection(args) == expected
