"""CLI command `imgret evaluate`: retrieval metrics of a stored query set ranked through the
index (``imgret.cli.jobs.gallery.evaluate_named``, the same code as ``POST /evaluate``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer


def register(app: typer.Typer, *, db_app: typer.Typer, index_app: typer.Typer) -> None:
    """Add this area's commands to the CLI."""

    @app.command("evaluate")
    def evaluate_command(
        query_set: str = typer.Option(..., "--query-set", help="a set stored by `imgret ingest "
                                      "PATH --query-set NAME`"),
        k: str = typer.Option("1,5,10", "--k", help="comma-separated cut-offs"),
        exclude_same_camera: bool = typer.Option(
            False, "--exclude-same-camera", help="re-ID rule: drop same-label same-camera items"
        ),
        model_version: str | None = typer.Option(
            None, "--model-version", help="default: IMGRET_MODEL's version, else the active one"
        ),
        worst: int = typer.Option(0, "--worst", min=0, max=100, help="list the n worst queries"),
        json_out: Path | None = typer.Option(None, "--json", help="also write the report here"),
        open_set: bool | None = typer.Option(
            None, "--open-set/--no-open-set",
            help="require the open-set section (FPIR/FNIR, TAR@FAR), or leave it out; "
                 "default: added when the queries are both mated and non-mated"),
        fpirs: str | None = typer.Option(
            None, "--fpir", metavar="F[,F...]",
            help="target FPIRs, each in (0, 1) (default 0.1,0.01,0.001)"),
        unknown_labels: list[str] | None = typer.Option(
            None, "--unknown-label",
            help="a query label declared unknown (must have no gallery item); repeatable"),
        rerank: str | None = typer.Option(
            None, "--rerank", metavar="METHOD",
            help="re-rank the results as /search does: k_reciprocal or query_expansion (not "
                 "kept as the version's last evaluation)",
        ),
        # Text here: the values are parsed and checked by RerankRequest, as the API's are.
        rerank_k1: str | None = typer.Option(
            None, "--rerank-k1", metavar="INTEGER", help="k_reciprocal: k1 (20)"
        ),
        rerank_k2: str | None = typer.Option(
            None, "--rerank-k2", metavar="INTEGER", help="k_reciprocal: k2 (6)"
        ),
        rerank_lambda: str | None = typer.Option(
            None, "--rerank-lambda", metavar="FLOAT",
            help="k_reciprocal: weight of the original distance (0.3)",
        ),
        rerank_candidates: str | None = typer.Option(
            None, "--rerank-candidates", metavar="INTEGER",
            help="k_reciprocal: candidates re-ranked (100)",
        ),
        rerank_top_m: str | None = typer.Option(
            None, "--rerank-top-m", metavar="INTEGER",
            help="query_expansion: neighbours averaged (5)",
        ),
        rerank_alpha: str | None = typer.Option(
            None, "--rerank-alpha", metavar="FLOAT", help="query_expansion: weight exponent (0)"
        ),
    ) -> None:
        """Evaluate a named query set through the index, exactly as POST /evaluate does."""
        try:
            ks = [int(part) for part in k.split(",") if part.strip()]
        except ValueError:
            raise typer.BadParameter(f"{k!r} is not a list of integers", param_hint="--k") from None
        from pydantic import ValidationError

        from imgret.cli.jobs.gallery import evaluate_named
        from imgret.cli.reports import format_report
        from imgret.service.request_rules import validation_message
        from imgret.service.schemas.common import RerankRequest
        from imgret.service.schemas.evaluation import EvaluateOptions
        from imgret.settings import Settings

        try:  # checked by the model behind /search's and /evaluate's rerank fields
            option = RerankRequest.parse({
                "rerank": rerank, "rerank_k1": rerank_k1, "rerank_k2": rerank_k2,
                "rerank_lambda": rerank_lambda, "rerank_candidates": rerank_candidates,
                "rerank_top_m": rerank_top_m, "rerank_alpha": rerank_alpha,
            })
        except ValueError as exc:
            # Its field names as this command's options: rerank_k1 -> --rerank-k1.
            message = re.sub(r"\brerank\w*", lambda m: "--" + m[0].replace("_", "-"), str(exc))
            typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None

        try:  # checked by the model behind /evaluate's fields
            request = EvaluateOptions.model_validate({
                "open_set": open_set, "unknown_labels": unknown_labels or None,
                "fpirs": [part for part in (fpirs or "").split(",") if part.strip()] or None,
            }).open_set_request()
        except ValidationError as exc:
            message = validation_message(exc)
            typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None

        report = evaluate_named(
            Settings(), query_set, ks=ks, exclude_same_camera=exclude_same_camera,
            model_version=model_version, worst=worst, rerank=option, open_set=request,
        )

        for line in format_report(report):
            typer.echo(line)
        for query in report.get("worst", []):
            neighbours = ", ".join(
                f"{n['label']}{'*' if n['relevant'] else ''} {n['score']:.3f}"
                for n in query["neighbours"][:5]
            )
            typer.echo(f"worst: query {query['index']} ({query['label']}): AP@R "
                       f"{query['average_precision_at_r']:.3f}; top: {neighbours}")
        if json_out is not None:
            json_out.write_text(json.dumps(report, indent=2, default=str))
            typer.echo(f"report written to {json_out}")
