"""CLI commands: `imgret models list|register|embed|compare|calibrate|activate|rollback|
delete`, the twins of ``/models`` and ``POST /evaluate {"compare": ...}``: each calls one
function of ``imgret.cli.jobs.models`` (which calls the same ``imgret.gallery.versions.lifecycle``
code as the service); and `imgret export VERSION --format onnx --out DIR [--quantize int8]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

models_app = typer.Typer(help="Model versions: register, re-embed, compare, switch, roll back, "
                              "delete.",
                         no_args_is_help=True)


def register(app: typer.Typer, **_: typer.Typer) -> None:
    """Add this area's commands to the CLI."""
    app.add_typer(models_app, name="models")
    app.command("export")(export_command)


def _settings():
    from imgret.settings import get_settings

    return get_settings()


@models_app.command("list")
def list_command(
    as_json: bool = typer.Option(False, "--json", help="print GET /models's JSON"),
) -> None:
    """Every version: active flag, coverage, index and re-embedding state, last evaluation."""
    from imgret.cli.jobs import models as model_commands

    listing = model_commands.list_models(_settings())
    if as_json:
        typer.echo(json.dumps(listing, default=str, indent=2))
        return
    typer.echo("| version | active | coverage | index | embedding | last MAP@R |")
    typer.echo("|---|---|---:|---|---|---:|")
    for info in listing["models"]:
        cov, last = info["coverage"], info["last_evaluation"] or {}
        map_r = f"{last['map_at_r']:.4f} ({last['query_set']})" if last.get("map_at_r") else ""
        typer.echo(f"| {info['version']} | {'yes' if info['active'] else ''} | "
                   f"{cov['embedded']}/{cov['live']} | {info['index']['state']} | "
                   f"{info['embedding']['state']} | {map_r} |")


@models_app.command("register")
def register_command(
    run: Path = typer.Argument(..., help="run directory from `imgret train`, or its model.pt"),
) -> None:
    """Register a checkpoint (stored in the database so every server can load it)."""
    from imgret.cli.jobs import models as model_commands

    info = model_commands.register(_settings(), run)
    typer.echo(f"registered {info['version']} (dim {info['dim']}); coverage "
               f"{info['coverage']['embedded']}/{info['coverage']['live']}")
    if not info["coverage"]["complete"]:
        typer.echo(f"next: imgret models embed {info['version']}")


@models_app.command("embed")
def embed_command(
    version: str = typer.Argument(..., help="a registered model version"),
    duty: float = typer.Option(1.0, "--duty", min=0.01, max=1.0,
                               help="share of the time spent computing (servers share the "
                                    "machine: 0.5 leaves half to them)"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Re-embed the stored gallery and query sets for VERSION (resumable), then build its
    index."""
    from tqdm import tqdm

    from imgret.cli.jobs import models as model_commands

    bar: Any = None

    def show(done: int, total: int) -> None:
        nonlocal bar
        if not progress:
            return
        if bar is None:
            bar = tqdm(total=total, desc=f"embedding {version}", unit="img")
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        report = model_commands.embed(_settings(), version, progress=show, duty=duty)
    finally:
        if bar is not None:
            bar.close()
    typer.echo(f"{version}: {report.gallery_embedded} gallery and {report.queries_embedded} "
               f"query items embedded in {report.seconds:.1f} s ({report.rate:.1f}/s)"
               + (f"; {len(report.failed)} stored images could not be decoded"
                  if report.failed else ""))


@models_app.command("compare")
def compare_command(
    a: str = typer.Argument(..., help="version A (the baseline)"),
    b: str = typer.Argument(..., help="version B (the candidate)"),
    query_set: str = typer.Option(..., "--query-set", help="a stored query set"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """B against A on the same queries: each metric, B − A with its paired 95% interval and
    the verdict (better / worse / no detectable difference)."""
    from imgret.cli.jobs import models as model_commands

    result = model_commands.compare(_settings(), a, b, query_set)
    if as_json:
        typer.echo(json.dumps(result, default=str, indent=2))
        return
    _print_comparison(result)


def _print_comparison(result: dict[str, Any]) -> None:
    typer.echo(f"A = {result['a']['model_version']}, B = {result['b']['model_version']}, "
               f"query set {result['a'].get('query_set')}")
    typer.echo("| metric | A | B | B − A | 95% CI | verdict |")
    typer.echo("|---|---:|---:|---:|---|---|")
    for metric, row in result["difference"].items():
        low, high = row["ci95"]
        verdict = result.get("verdict", {}).get(metric, "")
        typer.echo(f"| {metric} | {row['a']:.4f} | {row['b']:.4f} | {row['difference']:+.4f} "
                   f"| [{low:+.4f}, {high:+.4f}] | {verdict} |")


@models_app.command("calibrate")
def calibrate_command(
    version: str = typer.Argument(..., help="the version whose threshold to set"),
    query_set: str = typer.Option(..., "--query-set", help="a stored query set holding "
                                  "identities the gallery does not hold"),
    fpir: float = typer.Option(..., "--fpir", help="the target FPIR, in (0, 1)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Set VERSION's decision threshold: the lowest whose FPIR on the query set is at most
    --fpir (POST /models/{v}/calibrate)."""
    from imgret.cli.jobs import models as model_commands

    result = model_commands.calibrate(_settings(), version, query_set, fpir)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), default=str, indent=2))
        return
    ci = result.threshold_ci95
    interval = f" [{ci[0]:.6g}, {ci[1]:.6g}]" if ci else ""
    typer.echo(f"{version}: threshold {result.threshold:.6g}{interval} at target FPIR "
               f"{result.target_fpir:g} on {query_set!r} ({result.details['mated']} mated, "
               f"{result.details['non_mated']} non-mated queries): measured FPIR "
               f"{result.fpir:.4g}, FNIR {result.fnir:.4g}")


@models_app.command("activate")
def activate_command(
    version: str = typer.Argument(..., help="the version to serve"),
    require: list[str] | None = typer.Option(
        None, "--require", help="better | not_worse: switch only if the paired verdict "
                                "against the active version says so; fnir_not_worse: only if "
                                "VERSION's FNIR at its calibrated FPIR is not worse "
                                "(repeatable)"),
    query_set: str | None = typer.Option(None, "--query-set",
                                         help="the query set the verdict is taken on"),
) -> None:
    """Switch the served version (running servers follow within their follower interval)."""
    from imgret.cli.jobs import models as model_commands
    from imgret.errors import ImgretError

    if any(r not in ("better", "not_worse", "fnir_not_worse") for r in require or ()):
        raise typer.BadParameter("better, not_worse or fnir_not_worse", param_hint="--require")
    if require and query_set is None:
        raise typer.BadParameter("--require needs --query-set", param_hint="--query-set")
    try:
        result = model_commands.activate(_settings(), version, require=require,
                                     query_set=query_set)
    except ImgretError as exc:
        details = getattr(exc, "details", {})
        if details.get("comparison"):
            _print_comparison(details["comparison"])
        if details.get("open_set"):
            _print_fnir(details["open_set"])
        raise
    if result.comparison:
        _print_comparison(result.comparison)
    if result.open_set:
        _print_fnir(result.open_set)
    typer.echo(f"active: {result.active}" + (f" (was {result.previous})" if result.changed
                                               else " (already active)"))


def _print_fnir(result: dict[str, Any]) -> None:
    ci = result["ci95"]
    shown = f"[{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else "unresolved"
    typer.echo(f"FNIR at FPIR {result['fpir']:g} on {result.get('query_set')}: A "
               f"{result['a']['fnir']:.4f}, B {result['b']['fnir']:.4f}, B − A "
               f"{result['difference']:+.4f} {shown}: {result['verdict']}")


@models_app.command("rollback")
def rollback_command() -> None:
    """Serve the version the active one replaced again."""
    from imgret.cli.jobs import models as model_commands

    result = model_commands.rollback(_settings())
    typer.echo(f"active: {result.active} (rolled back from {result.previous})")


@models_app.command("delete")
def delete_command(
    version: str = typer.Argument(..., help="a version that is neither active nor the "
                                            "rollback target"),
) -> None:
    """Delete VERSION: its checkpoint, embeddings, query embeddings, saved index and row
    (``DELETE /models/{version}``)."""
    from imgret.cli.jobs.gallery import open_gallery
    from imgret.gallery.search.milvus_index import vector_dropper
    from imgret.gallery.versions import lifecycle

    settings = _settings()
    with open_gallery(settings) as sessions:
        lifecycle.delete_version(version, session_factory=sessions, data_dir=settings.data_dir,
                                 drop_vectors=vector_dropper(settings))
    typer.echo(f"deleted {version}")


def export_command(
    version: str = typer.Argument(..., help="a registered model version"),
    fmt: str = typer.Option("onnx", "--format", help="onnx (the one format)"),
    out: Path = typer.Option(..., "--out", help="folder to write into (created)"),
    quantize: str | None = typer.Option(
        None, "--quantize", help="int8: register VERSION's int8 version (ONNX Runtime static "
                                 "quantisation calibrated on stored gallery images) and "
                                 "export that"),
    calibration_images: int = typer.Option(256, "--calibration-images", min=1, max=10_000,
                                           help="stored gallery images to calibrate on"),
    query_set: str | None = typer.Option(
        None, "--query-set", help="with --quantize: re-embed the int8 version and compare it "
                                  "with VERSION on this stored query set"),
    speed_seconds: float = typer.Option(5.0, "--speed-seconds", min=0.0, max=600.0,
                                        help="with --quantize: time spent measuring images/s"),
) -> None:
    """Export VERSION: model.onnx (the network, dynamic batch), preprocessing.json (how an
    image becomes its input) and a Triton model repository (triton/NAME/). With --quantize
    int8, first register VERSION's int8 version and export that; with --query-set too, its
    report (speed beside the MAP@R difference and its interval) is printed and written to
    int8_report.json."""
    from imgret.cli.jobs import models as model_commands

    if fmt != "onnx":
        raise typer.BadParameter("onnx", param_hint="--format")
    if quantize not in (None, "int8"):
        raise typer.BadParameter("int8", param_hint="--quantize")
    if query_set is not None and quantize is None:
        raise typer.BadParameter("--query-set needs --quantize", param_hint="--query-set")
    settings = _settings()
    if quantize:
        made = model_commands.quantize(settings, version, images=calibration_images,
                                       speed_seconds=speed_seconds)
        typer.echo(f"registered {made.version}, the int8 version of {version} (calibrated on "
                   f"{made.calibration_images} stored images; cosine with {version}'s vectors "
                   f"mean {made.cosine_mean:.5f}, min {made.cosine_min:.5f})")
        report: dict[str, Any] = made.to_dict()
        if query_set is not None:
            model_commands.embed(settings, made.version, progress=lambda *_: None)
            report["comparison"] = model_commands.compare(settings, version, made.version,
                                                          query_set)
        _print_int8_report(report)
        out.mkdir(parents=True, exist_ok=True)
        (out / "int8_report.json").write_text(json.dumps(report, default=str, indent=2) + "\n")
        version = made.version
    files = model_commands.export(settings, version, out, fmt=fmt)
    for path in files.to_dict().values():
        typer.echo(path)
    if quantize and query_set is None:
        typer.echo(f"next: imgret models embed {version}, then imgret models activate {version} "
                   "--require not_worse --query-set NAME")


def _print_int8_report(report: dict[str, Any]) -> None:
    speed = report.get("speed") or {}
    if speed:
        base = speed["torch eager"]["images_per_s"]
        typer.echo(f"| runtime | images/s (batch {speed['torch eager']['batch']}) | "
                   "× torch eager |")
        typer.echo("|---|---:|---:|")
        for name, row in speed.items():
            typer.echo(f"| {name} | {row['images_per_s']:.1f} | "
                       f"{row['images_per_s'] / base:.2f} |")
    comparison = report.get("comparison")
    if comparison:
        _print_comparison(comparison)
        verdict = comparison.get("verdict", {}).get("map_at_r", "")
        typer.echo(f"MAP@R, int8 − float: {verdict}; activate with imgret models activate "
                   f"{report['version']} --require not_worse --query-set "
                   f"{comparison['a'].get('query_set')}")
