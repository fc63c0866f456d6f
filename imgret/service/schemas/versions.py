"""``/models``: a version's description, registration, calibration and activation."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import UploadFile
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from imgret.service.request_rules import (
    NAME_MAX,
    SafeText,
)
from imgret.service.schemas.common import RerankRequest


class Coverage(BaseModel):
    embedded: int = Field(description="live gallery items with a vector of this version")
    live: int = Field(description="live gallery items")
    fraction: float
    complete: bool


class IndexState(BaseModel):
    state: Literal["built", "missing"]
    size: int | None = None
    factory: str | None = None


class EmbeddingJob(BaseModel):
    state: Literal["idle", "running", "done", "failed", "interrupted"]
    error: str | None = None
    updated_at: datetime | None = None


class QueryCoverage(BaseModel):
    embedded: int
    total: int


class CalibrationInfo(BaseModel):
    """A version's decision threshold and what it was measured on."""

    id: int
    version: str
    query_set: str
    query_set_sha256: str = Field(description="SHA-256 over the query items' [id, sha256, "
                                              "label], in id order")
    target_fpir: float
    threshold: float
    threshold_ci95: list[float] | None
    fpir: float = Field(description="FPIR measured at the threshold on the query set")
    fnir: float = Field(description="FNIR measured at the threshold on the query set")
    rerank: dict[str, Any] | None = Field(description="the re-ranking it was calibrated with "
                                                      "(null: plain search)")
    details: dict[str, Any]
    created_at: datetime | None


class CalibrateRequest(RerankRequest):
    """``POST /models/{v}/calibrate``: the query set (with identities the gallery does not
    hold) and the FPIR the threshold must hold; re-ranking fields calibrate re-ranked
    search."""

    query_set: SafeText = Field(min_length=1, max_length=NAME_MAX)
    target_fpir: float = Field(gt=0.0, lt=1.0, description="in (0, 1), e.g. 0.01")


class RuntimeInfo(BaseModel):
    """What runs the version's network in the process that answered, and why
    (``IMGRET_RUNTIME``; docs/onnx.md)."""

    asked: str = Field(description="IMGRET_RUNTIME: auto, torch or onnxruntime")
    runtime: Literal["torch", "onnxruntime"]
    reason: str
    max_abs_diff: float | None = Field(
        None, description="ONNX Runtime's largest difference from torch on the version's "
                          "sample, where measured")
    bound: float | None = Field(None, description="the bound auto held it to")


class ModelInfo(BaseModel):
    """One model version: what it is, how much of the gallery it covers, whether it serves."""

    version: str
    dim: int
    config: dict[str, Any]
    created_at: datetime
    active: bool
    activated_at: datetime | None = None
    coverage: Coverage
    query_items: QueryCoverage
    index: IndexState
    embedding: EmbeddingJob
    checkpoint_stored: bool
    last_evaluation: dict[str, Any] | None = None
    calibration: CalibrationInfo | None = None
    decisions: str = Field("", description="the decisions it serves, or none and why")
    runtime: RuntimeInfo | None = Field(
        None, description="how the answering process runs its network; null where that "
                          "process has not loaded it")


class ModelList(BaseModel):
    active: str | None
    models: list[ModelInfo]
    history: list[dict[str, Any]] = Field(description="the last switches, newest first")


class RegisterRequest(BaseModel):
    """``POST /models`` as JSON: a checkpoint the server can read."""

    model_config = ConfigDict(extra="forbid")

    path: SafeText = Field(min_length=1, max_length=4096,
                           description="a run directory from `imgret train`, or its model.pt")


class RegisterUpload(BaseModel):
    """``POST /models`` as a multipart form: an uploaded checkpoint, or the path of one.

    ``path`` is any text here: the route checks it as it checks the JSON ``path``, and a
    path outside the model roots gets the one message every refused path gets.
    """

    checkpoint: UploadFile | None = Field(
        None, description="a checkpoint file (`model.pt` of `imgret train`), at most "
                          "IMGRET_MAX_CHECKPOINT_BYTES; or send `path`")
    path: str | None = Field(
        None, description="a run directory from `imgret train`, or its model.pt, under "
                          "<data_dir>/models or IMGRET_MODEL_ROOTS; or send `checkpoint`")

    @model_validator(mode="after")
    def _checkpoint_or_path(self) -> RegisterUpload:
        if (self.checkpoint is None) == (self.path is None):
            raise ValueError("send one of `checkpoint` (a file) or `path`")
        return self


class ActivateRequest(BaseModel):
    """Optional gate of a switch."""

    model_config = ConfigDict(extra="forbid")

    require: (Literal["better", "not_worse", "fnir_not_worse"]
              | list[Literal["better", "not_worse", "fnir_not_worse"]] | None) = Field(
        None, description="refuse (409) unless the paired verdict against the active version "
                          "on query_set says so; fnir_not_worse (alone, or in a list beside "
                          "better or not_worse): unless this version's FNIR at its "
                          "calibrated FPIR is not worse")
    query_set: SafeText | None = Field(None, min_length=1, max_length=NAME_MAX)

    def requirements(self) -> list[str] | None:
        """``require`` as a list (``None``: not given)."""
        if self.require is None:
            return None
        return [self.require] if isinstance(self.require, str) else list(self.require)


class Switch(BaseModel):
    """The served version after a switch."""

    active: str
    previous: str | None
    changed: bool = Field(description="false: the version was already active")
    stragglers_embedded: int = Field(
        0, description="items added since the re-embedding, embedded during the switch")
    comparison: dict[str, Any] | None = None
    open_set: dict[str, Any] | None = Field(
        None, description="require=fnir_not_worse: both versions' FNIR at the calibrated "
                          "FPIR, B - A with its paired 95% interval and the verdict")
