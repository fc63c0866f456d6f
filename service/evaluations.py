"""Evaluations and comparisons of model versions inside the service: the glue between the
process's open models and indexes (:class:`~service.resources.Resources`) and
:mod:`index.evaluation`. Used by ``POST /evaluate`` and by the gate of
``POST /models/{v}/activate``, so a refused switch shows the same numbers ``/evaluate`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from imgret.embedder import Embedder
from imgret.errors import GalleryError
from imgret.images import DecodeLimits
from index import evaluation, versions
from service.resources import Resources


def embedder_or_none(resources: Resources, version: str) -> Embedder | None:
    """The version's model when it can be loaded (needed only for queries without stored
    vectors of that version)."""
    try:
        return resources.embedder_for(version)
    except GalleryError:
        return None


def evaluate_version(
    resources: Resources, query_set: str, version: str, *, k: Sequence[int] | None = None,
    exclude_same_camera: bool = False, worst: int = 0,
) -> evaluation.Evaluation:
    """A named query set ranked through ``version``'s index (the served one, or another
    version's, opened once and kept up to date); recorded as the version's last evaluation."""
    return versions.evaluate_recorded(
        resources.searcher_for(version), query_set, session_factory=resources.sessions,
        embedder=embedder_or_none(resources, version), media=resources.media,
        max_pixels=resources.settings.max_image_pixels, k=k,
        exclude_same_camera=exclude_same_camera, worst=worst,
    )


def compare_named(
    resources: Resources, a: str, b: str, query_set: str, *,
    k: Sequence[int] | None = None, exclude_same_camera: bool = False, worst: int = 0,
) -> dict[str, Any]:
    """Versions ``a`` and ``b`` on one named query set, paired
    (:func:`index.versions.comparison_report`)."""
    options = dict(k=k, exclude_same_camera=exclude_same_camera, worst=worst)
    return versions.comparison_report(evaluate_version(resources, query_set, a, **options),
                           evaluate_version(resources, query_set, b, **options))


def evaluate_upload(
    resources: Resources, images: Sequence[bytes], labels: Sequence[str], *,
    cameras: Sequence[int] | None = None, version: str | None = None,
    k: Sequence[int] | None = None, exclude_same_camera: bool = False, worst: int = 0,
) -> evaluation.Evaluation:
    """Uploaded queries embedded with ``version``'s model (default the served one) and ranked
    through its index; model and index are taken together."""
    if version is None:
        serving = resources.serving
        embedder, searcher = serving.embedder, serving.searcher
    else:
        embedder, searcher = resources.embedder_for(version), resources.searcher_for(version)
    queries = evaluation.embed_queries(
        images, labels, embedder=embedder, cameras=cameras,
        limits=DecodeLimits.from_settings(resources.settings),
    )
    return evaluation.evaluate(searcher, queries, k=k,
                               exclude_same_camera=exclude_same_camera, worst=worst)
