"""Evaluating and comparing model versions inside the service: the glue between the
process's open models and indexes (:class:`~imgret.service.resources.bundle.Resources`) and
:mod:`imgret.gallery.evaluation.retrieval`. Used by ``POST /evaluate`` (:func:`evaluate_named`,
:func:`evaluate_uploaded`) and by the gate of ``POST /models/{v}/activate``, so a refused
switch shows the same numbers ``/evaluate`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from imgret.embedder import Embedder
from imgret.errors import GalleryError
from imgret.gallery.evaluation import calibration as calibrations
from imgret.gallery.evaluation import retrieval
from imgret.gallery.evaluation.open_set import OpenSetRequest
from imgret.gallery.search.rerank import Rerank
from imgret.gallery.storage import query_set_store
from imgret.gallery.versions import lifecycle, version_store
from imgret.images import DecodeLimits
from imgret.service.request_rules import NotFound
from imgret.service.resources.bundle import Resources


def embedder_or_none(resources: Resources, version: str) -> Embedder | None:
    """The version's model when it can be loaded (needed only for queries without stored
    vectors of that version)."""
    try:
        return resources.embedder_for(version)
    except GalleryError:
        return None


def evaluate_version(
    resources: Resources, query_set: str, version: str, *, k: Sequence[int] | None = None,
    exclude_same_camera: bool = False, worst: int = 0, rerank: Rerank | None = None,
    open_set: OpenSetRequest | None = None, record: bool = True,
) -> retrieval.Evaluation:
    """A named query set ranked through ``version``'s index (the served one, or another
    version's, opened once and kept up to date); recorded as the version's last evaluation,
    unless re-ranked (a search option, not the model: see
    :mod:`imgret.gallery.evaluation.retrieval`)
    or ``record`` is false."""
    options = dict(
        session_factory=resources.sessions, embedder=embedder_or_none(resources, version),
        media=resources.media, max_pixels=resources.settings.max_image_pixels, k=k,
        exclude_same_camera=exclude_same_camera, worst=worst, open_set=open_set,
    )
    run = lifecycle.evaluate_recorded if record else retrieval.evaluate_query_set
    return run(resources.searcher_for(version), query_set, rerank=rerank, **options)


def compare_named(
    resources: Resources, a: str, b: str, query_set: str, *,
    k: Sequence[int] | None = None, exclude_same_camera: bool = False, worst: int = 0,
    rerank: Rerank | None = None, open_set: OpenSetRequest | None = None,
) -> dict[str, Any]:
    """Versions ``a`` and ``b`` on one named query set, paired
    (:func:`imgret.gallery.versions.lifecycle.comparison_report`), both ranked with ``rerank``."""
    options = dict(k=k, exclude_same_camera=exclude_same_camera, worst=worst, rerank=rerank,
                   open_set=open_set)
    return lifecycle.comparison_report(evaluate_version(resources, query_set, a, **options),
                                       evaluate_version(resources, query_set, b, **options))


def compare_rerank(
    resources: Resources, version: str, query_set: str, rerank: Rerank, *,
    k: Sequence[int] | None = None, exclude_same_camera: bool = False, worst: int = 0,
    open_set: OpenSetRequest | None = None,
) -> dict[str, Any]:
    """One version's plain search (A, recorded as usual) and its re-ranked search (B) on one
    named query set, paired like two versions: B − A per metric with its 95% interval."""
    options = dict(k=k, exclude_same_camera=exclude_same_camera, worst=worst,
                   open_set=open_set)
    return lifecycle.comparison_report(
        evaluate_version(resources, query_set, version, **options),
        evaluate_version(resources, query_set, version, rerank=rerank, **options),
    )


def evaluate_upload(
    resources: Resources, images: Sequence[bytes], labels: Sequence[str], *,
    cameras: Sequence[int] | None = None, version: str | None = None,
    k: Sequence[int] | None = None, exclude_same_camera: bool = False, worst: int = 0,
    rerank: Rerank | None = None, open_set: OpenSetRequest | None = None,
) -> retrieval.Evaluation:
    """Uploaded queries embedded with ``version``'s model (default the served one) and ranked
    through its index; model and index are taken together."""
    if version is None:
        serving = resources.serving
        embedder, searcher = serving.embedder, serving.searcher
    else:
        embedder, searcher = resources.embedder_for(version), resources.searcher_for(version)
    queries = retrieval.embed_queries(
        images, labels, embedder=embedder, cameras=cameras,
        limits=DecodeLimits.from_settings(resources.settings),
    )
    return retrieval.evaluate(searcher, queries, k=k, exclude_same_camera=exclude_same_camera,
                               worst=worst, rerank=rerank, session_factory=resources.sessions,
                               open_set=open_set)


def require_known(resources: Resources, *, query_set: str | None = None,
                  model_versions: Sequence[str | None] = ()) -> None:
    """Refuse, before any work, a query set or model version that was never stored.

    Raises:
        NotFound: naming it (and the stored versions).
    """
    with resources.sessions() as session:
        known = {row.version for row in version_store.list_model_versions(session=session)}
        for version in model_versions:
            if version is not None and version not in known:
                raise NotFound(
                    f"unknown model version {version!r}; stored: {', '.join(sorted(known))}"
                )
        if query_set is None:
            return
        try:
            query_set_store.load_query_set(query_set, session=session)
        except GalleryError as exc:
            raise NotFound(str(exc)) from None


def compare_open_set(resources: Resources, a: str, b: str, query_set: str,
                     calibration: calibrations.Calibration) -> dict[str, Any]:
    """B's FNIR against A's on one named query set, each at its own threshold for the
    calibration's target FPIR, ranked with the calibration's search option (the gate
    ``require=fnir_not_worse``: :func:`imgret.gallery.versions.lifecycle.fnir_comparison`). Not
    recorded as either version's last evaluation."""
    request = OpenSetRequest(enabled=True, fpirs=(calibration.target_fpir,))
    a_eval, b_eval = (evaluate_version(resources, query_set, version, open_set=request,
                                       rerank=calibration.rerank_option(), record=False)
                      for version in (a, b))
    return lifecycle.fnir_comparison(a_eval, b_eval, calibration.target_fpir)


def calibrate_version(resources: Resources, version: str, query_set: str, target_fpir: float,
                      *, rerank: Rerank | None = None) -> calibrations.Calibration:
    """``POST /models/{v}/calibrate``: :func:`imgret.gallery.evaluation.calibration.calibrate`
    through the version's index; when it is the served version, this process serves the new
    threshold before answering (the others follow within their follower interval).

    Raises:
        NotFound: unknown version or query set.
        EvaluationError: a target outside (0, 1), an empty set, one without non-mated
            queries, too few of them for the target.
    """
    calibrations.check_fpir(target_fpir)
    require_known(resources, query_set=query_set, model_versions=[version])
    result = calibrations.calibrate(
        resources.searcher_for(version), query_set, target_fpir,
        session_factory=resources.sessions, embedder=embedder_or_none(resources, version),
        media=resources.media, max_pixels=resources.settings.max_image_pixels, rerank=rerank,
    )
    # From the database, not from ``version``: a switch made meanwhile is not undone.
    resources.follow_active()
    return result


def evaluate_named(
    resources: Resources, query_set: str, a: str, b: str | None = None, *,
    k: Sequence[int] | None = None, exclude_same_camera: bool = False, worst: int = 0,
    rerank: Rerank | None = None, rerank_compare: bool = False,
    open_set: OpenSetRequest | None = None,
) -> dict[str, Any]:
    """``POST /evaluate`` with a named query set: version ``a`` alone, ``a`` against ``b``
    (:func:`compare_named`), or ``a``'s plain search against its re-ranked one
    (``rerank_compare``: :func:`compare_rerank`)."""
    require_known(resources, query_set=query_set, model_versions=[a, b])
    options = dict(k=k, exclude_same_camera=exclude_same_camera, worst=worst,
                   open_set=open_set)
    if b is not None:
        return compare_named(resources, a, b, query_set, rerank=rerank, **options)
    if rerank_compare and rerank is not None:
        return compare_rerank(resources, a, query_set, rerank, **options)
    return evaluate_version(resources, query_set, a, rerank=rerank, **options).report


def evaluate_uploaded(
    resources: Resources, images: Sequence[bytes], labels: Sequence[str], *,
    cameras: Sequence[int] | None = None, model_versions: Sequence[str] = (),
    k: Sequence[int] | None = None, exclude_same_camera: bool = False, worst: int = 0,
    rerank: Rerank | None = None, open_set: OpenSetRequest | None = None,
) -> dict[str, Any]:
    """``POST /evaluate`` with uploaded queries: the served version (no ``model_versions``), one
    version, or two compared on the same uploads (each embeds them with its own model)."""
    require_known(resources, model_versions=model_versions)
    results = [
        evaluate_upload(resources, images, labels, cameras=cameras, version=version, k=k,
                        exclude_same_camera=exclude_same_camera, worst=worst, rerank=rerank,
                        open_set=open_set)
        for version in (model_versions or [None])
    ]
    if len(results) == 1:
        return results[0].report
    return lifecycle.comparison_report(*results)
