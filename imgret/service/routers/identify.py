"""POST /identify: who is in one image, or nobody, under the served version's calibrated
threshold (:mod:`imgret.gallery.evaluation.calibration`).

The image is queued and batched like a ``/search`` query (the same queue, limits and 503s);
the decision uses the calibration carried with the version that embedded and ranked it.
"""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter, Request

from imgret.gallery.evaluation.calibration import NotCalibrated
from imgret.service import unknowns
from imgret.service.deps import ResourcesDep
from imgret.service.forms import form_body, open_form
from imgret.service.pipeline import ImageQuery, decision, decision_top
from imgret.service.schemas.search import IdentifyForm, IdentifyResponse

router = APIRouter(prefix="/identify", tags=["search"])

UNKNOWN = "unknown"


@router.post(
    "",
    responses={
        400: {"description": "a malformed multipart body"},
        409: {"description": "the served version has no calibration (or one for re-ranked "
                             "search): it serves no decisions"},
        413: {"description": "upload, image or decoded pixels over the limits"},
        422: {"description": "not an image, or invalid fields"},
        503: {"description": "the search queue is full or the server is shutting down; "
                             "retry after Retry-After seconds"},
    },
    openapi_extra=form_body(IdentifyForm),
)
async def identify(request: Request, resources: ResourcesDep) -> IdentifyResponse:
    """The identity in ``image``: the best matching identity's label when its score reaches
    the served version's calibrated threshold (``POST /models/{v}/calibrate``), else
    ``"unknown"`` (``known`` false). The score is the identity's template score (the query
    against the mean of its items; docs/identities.md), or the best item's for a version
    calibrated before identity scores. ``margin`` is ``score - threshold``; score and threshold
    always come from the same version (``model_version``). Where the collection keeps
    unknowns (``unknowns_days``, ``PATCH /collections/{name}``), an unknown image is kept and
    clustered: ``unknown_id`` and ``cluster_id`` name it (docs/identities.md).
    """
    async with open_form(request, IdentifyForm) as form:
        data = await form.image.read()
        # Every plain search keeps FETCH_MIN candidates: the decision proposes identities
        # among them (docs/identities.md).
        answer = await resources.batcher.submit(ImageQuery(data, 1))
    top = await anyio.to_thread.run_sync(decision_top, answer)
    made, note = decision(answer, top, None)
    if made is None:
        raise NotCalibrated(note or "no decision")
    kept = None
    if not made.known and answer.vector is not None:
        kept = await anyio.to_thread.run_sync(unknowns.keep, resources, data, answer.vector,
                                              answer.serving, made.score)
    return IdentifyResponse(
        label=made.label if made.known and made.label is not None else UNKNOWN,
        known=made.known, score=made.score, threshold=made.threshold, margin=made.margin,
        model_version=answer.serving.version,
        unknown_id=None if kept is None else kept.id,
        cluster_id=None if kept is None else kept.cluster_id,
    )
