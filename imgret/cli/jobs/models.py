"""The `imgret models ...` commands, one function each: open the gallery of the settings in
force and call :mod:`imgret.gallery.versions.lifecycle` (the same functions ``/models`` calls in the
service).

A switch made here is committed to the database; running servers follow it within their
follower interval (they poll the active version with the change log).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from imgret.cli.jobs.gallery import open_gallery
from imgret.gallery.evaluation import calibration as calibrations
from imgret.gallery.media.blobs import open_media_store
from imgret.gallery.versions import intake, lifecycle, quantization, reembed
from imgret.onnx_export import OnnxExport, export_onnx
from imgret.settings import Settings


def list_models(settings: Settings) -> dict[str, Any]:
    """`imgret models list`: what ``GET /models`` shows."""
    with open_gallery(settings) as sessions:
        return {
            "active": lifecycle.active_version(session_factory=sessions),
            "models": lifecycle.describe(session_factory=sessions, data_dir=settings.data_dir),
            "history": lifecycle.history(session_factory=sessions),
        }


def register(settings: Settings, run: str | Path) -> dict[str, Any]:
    """`imgret models register RUN`: what ``POST /models {"path": RUN}`` does."""
    with open_gallery(settings) as sessions:
        return intake.register_checkpoint(run, session_factory=sessions,
                                          data_dir=settings.data_dir)


def embed(settings: Settings, version: str, *,
          progress: Callable[[int, int], None] | None = None,
          duty: float = 1.0) -> reembed.EmbedReport:
    """`imgret models embed VERSION`: the re-embedding job of ``POST /models/{v}/embed``, in
    this process (claimed like the service's, so the two never run the same job at once),
    then the version's index built and saved.

    Args:
        duty: share of the time it computes (1: flat out; a server on the same machine may
            want less).
    """
    from imgret.gallery.search import Searcher

    with open_gallery(settings) as sessions:
        embedder = intake.load_embedder(version, session_factory=sessions,
                                        data_dir=settings.data_dir, device=settings.device,
                                        runtime=settings.runtime)
        report = reembed.run_embed_job(
            version, session_factory=sessions, media=open_media_store(settings, sessions),
            embedder=embedder, throttle=reembed.Throttle(duty=duty),
            max_pixels=settings.max_image_pixels, progress=progress,
        )
        Searcher.from_settings(sessions, settings, version).save()
        return report


def export(settings: Settings, version: str, out: str | Path, *,
           fmt: str = "onnx") -> OnnxExport:
    """`imgret export VERSION --format onnx --out DIR`: the version's stored checkpoint (checked
    to be its weights) as ``model.onnx`` (a quantised version's own graph), ``preprocessing.json``
    and a Triton model repository under ``triton/`` (:func:`imgret.onnx_export.export_onnx`)."""
    if fmt != "onnx":
        raise ValueError(f"unknown export format {fmt!r}; known: onnx")
    with open_gallery(settings) as sessions:
        loaded = intake.load_version_checkpoint(version, session_factory=sessions,
                                                data_dir=settings.data_dir)
    return export_onnx(loaded.model, loaded.spec, out, model_version=version,
                       graph=loaded.quantized.graph if loaded.quantized else None)


def quantize(settings: Settings, version: str, *, images: int = quantization.CALIBRATION_IMAGES,
             speed_seconds: float = 5.0) -> quantization.Int8Version:
    """`imgret export VERSION --quantize int8`: the int8 version of ``version``, calibrated
    on stored gallery images and registered
    (:func:`imgret.gallery.versions.quantization.quantize_version`)."""
    with open_gallery(settings) as sessions:
        return quantization.quantize_version(
            version, session_factory=sessions, data_dir=settings.data_dir,
            media=open_media_store(settings, sessions), max_pixels=settings.max_image_pixels,
            images=images, speed_seconds=speed_seconds)


def compare(settings: Settings, a: str, b: str, query_set: str, *,
            k: list[int] | None = None) -> dict[str, Any]:
    """`imgret models compare A B --query-set NAME`: ``POST /evaluate {"compare": [a, b]}``."""
    with open_gallery(settings) as sessions:
        return _compare(settings, sessions, a, b, query_set, k)


def calibrate(settings: Settings, version: str, query_set: str,
              target_fpir: float) -> calibrations.Calibration:
    """`imgret models calibrate VERSION --query-set NAME --fpir F`: ``POST
    /models/{v}/calibrate`` (the same function, through the version's index). Running
    servers take the new threshold up within their follower interval."""
    from imgret.errors import GalleryError
    from imgret.gallery.search import Searcher

    calibrations.check_fpir(target_fpir)
    with open_gallery(settings) as sessions:
        lifecycle.describe_one(version, session_factory=sessions,
                               data_dir=settings.data_dir)  # an unknown version raises here
        try:
            embedder = intake.load_embedder(version, session_factory=sessions,
                                            data_dir=settings.data_dir,
                                            device=settings.device,
                                            runtime=settings.runtime)
        except GalleryError:
            embedder = None  # stored query vectors may still exist
        return calibrations.calibrate(
            Searcher.from_settings(sessions, settings, version), query_set, target_fpir,
            session_factory=sessions, embedder=embedder,
            media=open_media_store(settings, sessions), max_pixels=settings.max_image_pixels,
        )


def activate(settings: Settings, version: str, *, require: str | list[str] | None = None,
             query_set: str | None = None, reason: str = "activate") -> lifecycle.Activation:
    """`imgret models activate VERSION [--require better|not_worse|fnir_not_worse ...
    --query-set NAME]`."""
    from imgret.gallery.search import Searcher

    with open_gallery(settings) as sessions:
        return lifecycle.activate(
            version, session_factory=sessions, data_dir=settings.data_dir,
            media=open_media_store(settings, sessions),
            embedder=intake.load_embedder(version, session_factory=sessions,
                                          data_dir=settings.data_dir,
                                          device=settings.device,
                                          runtime=settings.runtime),
            require=require, query_set=query_set,
            compare=lambda a, b, name: _compare(settings, sessions, a, b, name, None),
            compare_fnir=lambda a, b, name, calibration: _compare_fnir(
                settings, sessions, a, b, name, calibration),
            prepare_index=lambda v: Searcher.from_settings(sessions, settings, v).save(),
            reason=reason, max_pixels=settings.max_image_pixels,
        )


def rollback(settings: Settings) -> lifecycle.Activation:
    """`imgret models rollback`: ``POST /models/rollback``."""
    with open_gallery(settings) as sessions:
        previous = lifecycle.previous_version(session_factory=sessions)
    return activate(settings, previous, reason="rollback")


def _compare_fnir(settings: Settings, sessions, a: str, b: str, query_set: str,
                  calibration: calibrations.Calibration) -> dict[str, Any]:
    """The service's ``compare_open_set``, on this process's own indexes."""
    from imgret.errors import GalleryError
    from imgret.gallery.evaluation.retrieval import OpenSetRequest, evaluate_query_set
    from imgret.gallery.search import Searcher

    media = open_media_store(settings, sessions)
    request = OpenSetRequest(enabled=True, fpirs=(calibration.target_fpir,))
    results = []
    for version in (a, b):
        try:
            embedder = intake.load_embedder(version, session_factory=sessions,
                                            data_dir=settings.data_dir,
                                            device=settings.device,
                                            runtime=settings.runtime)
        except GalleryError:
            embedder = None  # stored query vectors may still exist
        results.append(evaluate_query_set(
            Searcher.from_settings(sessions, settings, version), query_set,
            session_factory=sessions, embedder=embedder, media=media,
            max_pixels=settings.max_image_pixels, rerank=calibration.rerank_option(),
            open_set=request,
        ))
    return lifecycle.fnir_comparison(*results, calibration.target_fpir)


def _compare(settings: Settings, sessions, a: str, b: str, query_set: str,
             k: list[int] | None) -> dict[str, Any]:
    from imgret.errors import GalleryError
    from imgret.gallery.search import Searcher

    media = open_media_store(settings, sessions)
    results = []
    for version in (a, b):
        try:
            embedder = intake.load_embedder(version, session_factory=sessions,
                                            data_dir=settings.data_dir,
                                            device=settings.device,
                                            runtime=settings.runtime)
        except GalleryError:
            embedder = None  # stored query vectors may still exist
        results.append(lifecycle.evaluate_recorded(
            Searcher.from_settings(sessions, settings, version), query_set,
            session_factory=sessions, embedder=embedder, media=media,
            max_pixels=settings.max_image_pixels, k=k,
        ))
    return lifecycle.comparison_report(*results)
