"""`imgret models ...` (the CLI twins of /models) and `imgret evaluate`, on a real database
(SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint
from imgret.cli.main import app
from imgret.gallery.versions.lifecycle import VersionInUse


@pytest.fixture
def env(cli_env: Path) -> Path:
    """The CLI's environment; yields a second checkpoint's run directory."""
    torch.manual_seed(3)
    other = cli_env / "other"
    save_checkpoint(other, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)))
    return other


def _checkpoint(folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    save_checkpoint(folder, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)))
    return folder


def run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def test_register_embed_compare_activate_rollback(env: Path, image_folder: Path) -> None:
    run("ingest", str(image_folder), "--no-progress")
    run("ingest", str(image_folder), "--query-set", "q", "--no-progress")
    run("evaluate", "--query-set", "q")
    listing = json.loads(run("models", "list", "--json"))
    a = listing["active"]
    assert listing["models"][0]["last_evaluation"]["query_set"] == "q"  # on record
    out = run("models", "register", str(env))
    b = out.split()[1]
    assert f"next: imgret models embed {b}" in out

    refused = CliRunner().invoke(app, ["models", "activate", b])
    assert refused.exit_code != 0 and "re-embed first" in str(refused.exception)

    out = run("models", "embed", b, "--no-progress")
    assert "20 gallery and 20 query items embedded" in out
    listing = json.loads(run("models", "list", "--json"))
    info = {m["version"]: m for m in listing["models"]}[b]
    assert info["coverage"]["complete"] and info["index"]["state"] == "built"
    assert info["embedding"]["state"] == "done"

    compared = json.loads(run("models", "compare", a, b, "--query-set", "q", "--json"))
    assert set(compared["verdict"]) >= {"map_at_r", "precision_at_1"}
    assert compared["a"]["model_version"] == a and compared["b"]["model_version"] == b
    assert "| map_at_r |" in run("models", "compare", a, b, "--query-set", "q")

    assert f"active: {b} (was {a})" in run("models", "activate", b)
    assert "yes" in [line for line in run("models", "list").splitlines() if b in line][0]
    assert f"active: {a} (rolled back from {b})" in run("models", "rollback")
    assert json.loads(run("models", "list", "--json"))["active"] == a

    # B is the rollback target now (A replaced it): kept; A is active: kept.
    for kept in (a, b):
        refused = CliRunner().invoke(app, ["models", "delete", kept])
        assert isinstance(refused.exception, VersionInUse), refused.exception
    c = run("models", "register", str(_checkpoint(env.parent / "third", seed=4))).split()[1]
    assert f"deleted {c}" in run("models", "delete", c)
    assert [m["version"] for m in json.loads(run("models", "list", "--json"))["models"]] == [a, b]


def test_cli_errors_are_domain_errors(env: Path) -> None:
    """``imgret`` (imgret.cli.main.main) prints an ImgretError as one line, without a traceback."""
    from imgret.errors import ImgretError

    for args in (["models", "activate", "nope"], ["models", "rollback"],
                 ["models", "delete", "nope"], ["models", "register", "/nonexistent/run"],
                 ["models", "embed", "nope"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code != 0
        assert isinstance(result.exception, ImgretError), (args, result.exception)


def test_evaluate_rerank_is_the_endpoints_report_and_not_recorded(
    env: Path, image_folder: Path, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient

    from imgret.service.app import create_app
    from imgret.settings import Settings
    from tests.support.images import write_image_folder

    queries = write_image_folder(tmp_path / "queries", classes=4, per_class=3, seed=5)
    run("ingest", str(image_folder), "--no-progress")
    run("ingest", str(queries), "--query-set", "q", "--no-progress")
    plain_path, reranked_path = tmp_path / "plain.json", tmp_path / "reranked.json"
    run("evaluate", "--query-set", "q", "--json", str(plain_path))
    recorded = json.loads(run("models", "list", "--json"))["models"][0]["last_evaluation"]
    out = run("evaluate", "--query-set", "q", "--rerank", "k_reciprocal", "--rerank-k1", "5",
              "--rerank-candidates", "50", "--json", str(reranked_path))
    assert "re-ranked by k_reciprocal" in out
    plain, reranked = (json.loads(p.read_text()) for p in (plain_path, reranked_path))
    assert plain["rerank"] is None
    assert reranked["rerank"] == {"method": "k_reciprocal", "k1": 5, "k2": 6,
                                  "lambda_value": 0.3, "candidates": 50}
    # The plain evaluation stays the version's last one.
    assert json.loads(run("models", "list", "--json"))["models"][0]["last_evaluation"] == recorded

    # The same numbers as POST /evaluate with the same options, on the same database.
    with TestClient(create_app(Settings())) as client:
        body = client.post("/evaluate", json={"query_set": "q", "rerank": "k_reciprocal",
                                              "rerank_k1": 5, "rerank_candidates": 50}).json()
    for name in ("map_at_r", "mean_average_precision", "precision_at_1", "recall_at_k"):
        assert reranked[name] == body[name], name


@pytest.mark.parametrize(("options", "message"), [
    (["--rerank", "bogus"], "error: --rerank: Input should be 'k_reciprocal' or "
                            "'query_expansion'"),
    (["--rerank", "k_reciprocal", "--rerank-lambda", "1.5"],
     "error: --rerank-lambda: Input should be less than or equal to 1"),
    (["--rerank", "k_reciprocal", "--rerank-k1", "abc"],
     "error: --rerank-k1: must be a whole number written with digits only"),
    (["--rerank", "k_reciprocal", "--rerank-top-m", "3"],
     "error: --rerank-top-m: a parameter of --rerank=query_expansion"),
    (["--rerank-alpha", "1"], "error: --rerank-alpha: re-ranking parameters need --rerank="),
])
def test_evaluate_bad_rerank_options_are_one_line(env: Path, options: list[str],
                                                  message: str) -> None:
    result = CliRunner().invoke(app, ["evaluate", "--query-set", "q", *options])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
