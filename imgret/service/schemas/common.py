"""What several resources share: request limits, the re-ranking options, form helpers."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import UploadFile
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from imgret.gallery.search.rerank import (
    ALPHA_MAX,
    CANDIDATES_MAX,
    K1_MAX,
    TOP_M_MAX,
    Rerank,
    rerank_options,
)
from imgret.service.request_rules import (
    WholeNumber,
    text_problem,
    validation_message,
)

K_MAX = 1000


WORST_MAX = 100


FPIRS_MAX = 10


UNKNOWN_LABELS_MAX = 1000


ID_MAX = 2**63 - 1


_INTEGER = re.compile(r"[+-]?[0-9]+")


RERANK_FIELDS = ("rerank", "rerank_k1", "rerank_k2", "rerank_lambda", "rerank_candidates",
                 "rerank_top_m", "rerank_alpha")


_RERANK_PARAMS = {
    None: (),
    "k_reciprocal": ("rerank_k1", "rerank_k2", "rerank_lambda", "rerank_candidates"),
    "query_expansion": ("rerank_top_m", "rerank_alpha"),
}


class RerankRequest(BaseModel):
    """Re-ranking of the results (``imgret.gallery.search.rerank``): the same fields in
    ``/search``'s form, ``/evaluate``'s JSON and form, and ``imgret evaluate``'s options. Parameters
    left out take the method's defaults; a parameter of the other method, or one without
    ``rerank``, is refused (422)."""

    model_config = ConfigDict(extra="forbid")

    rerank: Literal["k_reciprocal", "query_expansion"] | None = Field(
        None, description="k_reciprocal: Zhong et al. 2017 over the top rerank_candidates; "
                          "query_expansion: search again with the query averaged with its "
                          "top rerank_top_m. Default: no re-ranking")
    rerank_k1: WholeNumber | None = Field(None, ge=1, le=K1_MAX,
                                  description="k_reciprocal: k1 (default 20)")
    rerank_k2: WholeNumber | None = Field(None, ge=1, le=K1_MAX + 1,
                                  description="k_reciprocal: k2, 1 = no local expansion "
                                              "(default 6)")
    rerank_lambda: float | None = Field(None, ge=0.0, le=1.0,
                                        description="k_reciprocal: weight of the original "
                                                    "distance (default 0.3)")
    rerank_candidates: WholeNumber | None = Field(
        None, ge=1, le=CANDIDATES_MAX,
        description="k_reciprocal: N, candidates re-ranked per query (default 100); items "
                    "below rank N keep their order")
    rerank_top_m: WholeNumber | None = Field(None, ge=1, le=TOP_M_MAX,
                                     description="query_expansion: neighbours averaged "
                                                 "(default 5)")
    rerank_alpha: float | None = Field(None, ge=0.0, le=ALPHA_MAX,
                                       description="query_expansion: weight exponent, 0 = "
                                                   "plain average (default 0)")

    @model_validator(mode="after")
    def _check_rerank(self) -> RerankRequest:
        given = [name for name in RERANK_FIELDS[1:] if getattr(self, name) is not None]
        if self.rerank is None and given:
            raise ValueError(f"{', '.join(given)}: re-ranking parameters need rerank="
                             "k_reciprocal or rerank=query_expansion")
        wrong = [name for name in given if name not in _RERANK_PARAMS[self.rerank]]
        if wrong:
            other = next(m for m in _RERANK_PARAMS if m not in (None, self.rerank))
            raise ValueError(f"{', '.join(wrong)}: a parameter of rerank={other}, not of "
                             f"rerank={self.rerank}")
        self.rerank_option()
        return self

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> Rerank | None:
        """The re-ranking that ``rerank`` / ``rerank_*`` values name, checked by this model:
        the one parser of ``/search``'s form, ``/evaluate``'s form and ``imgret evaluate``'s
        options (``/evaluate``'s JSON validates the model itself).

        Args:
            values: field name -> value as sent (text or typed); ``None`` or blank text is
                "not sent".

        Raises:
            ValueError: one line, ``field: reason; ...`` (the routers answer it with 422).
        """
        sent = {name: value.strip() if isinstance(value, str) else value
                for name, value in values.items()}
        try:
            request = cls.model_validate(
                {name: value for name, value in sent.items() if value not in (None, "")}
            )
        except ValidationError as exc:
            raise ValueError(validation_message(exc)) from None
        return request.rerank_option()

    def rerank_option(self) -> Rerank | None:
        """The ``imgret.gallery.search.rerank`` options these fields name (``None``: plain search).

        Raises:
            ValueError: a parameter of the other method, or one without ``rerank``.
        """
        return rerank_options(
            self.rerank, k1=self.rerank_k1, k2=self.rerank_k2,
            lambda_value=self.rerank_lambda, candidates=self.rerank_candidates,
            top_m=self.rerank_top_m, alpha=self.rerank_alpha,
        )


def _storable_file_name(upload: UploadFile) -> UploadFile:
    # The client's file name is kept as a note (``source``): it must be storable text.
    problem = text_problem(upload.filename) if upload.filename else None
    if problem is not None:
        raise ValueError(f"file name {problem}")
    return upload


def _count_problem(name: str, values: list[Any] | None, n: int) -> str | None:
    if values is None or len(values) == n:
        return None
    return f"{len(values)} {name} for {n} images: send one {name[:-1]} per image, in order"
