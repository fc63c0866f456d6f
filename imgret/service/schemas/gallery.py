"""``/gallery``: an upload's form, an item, a listing, an add's outcome."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import UploadFile
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    model_validator,
)

from imgret.service.request_rules import (
    Camera,
    JsonObject,
    Label,
)
from imgret.service.schemas.common import _count_problem, _storable_file_name


class GalleryItemPublic(BaseModel):
    """A gallery item as the API shows it."""

    id: int
    label: str
    camera: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    content_type: str
    sha256: str
    uri: str = Field(description="where to fetch the stored image")
    created_at: datetime


class GalleryItemList(BaseModel):
    """One page of gallery items and the number of items matching the filter."""

    data: list[GalleryItemPublic]
    count: int = Field(description="items matching the filter, over all pages")
    offset: int
    limit: int


class GalleryAddOutcome(BaseModel):
    """What happened to one uploaded image.

    ``created``: a new item with the label, camera and metadata sent. ``existing``: the same
    bytes were already a live item; nothing was changed, and ``label``/``camera``/``metadata``
    are what is stored (the values sent were not applied). ``duplicate``: the same bytes
    appeared earlier in this request; ``id`` is that image's item.
    """

    id: int
    status: Literal["created", "existing", "duplicate"]
    label: str
    camera: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class GalleryItemsCreated(BaseModel):
    """The ids of the uploaded items, in upload order, and what happened to each.

    An image whose bytes were already in the gallery is not stored twice: its existing id
    is returned, its ``created`` entry is false and ``items[i].status`` says why.
    """

    ids: list[int]
    created: list[bool]
    items: list[GalleryAddOutcome]


class GalleryUpload(BaseModel):
    """``POST /gallery``'s form: images, each with its label (and camera, metadata)."""

    images: list[Annotated[UploadFile, AfterValidator(_storable_file_name)]] = Field(
        description="image files, one per item")
    labels: list[Label] = Field(description="one label per image, in order")
    cameras: list[Camera] | None = Field(None, description="one camera id per image (re-ID "
                                                           "data)")
    metadata: list[JsonObject] | None = Field(
        None, description="JSON objects: one per image, or one for all images")

    @model_validator(mode="after")
    def _one_per_image(self) -> GalleryUpload:
        n = len(self.images)
        problem = _count_problem("labels", self.labels, n) or _count_problem(
            "cameras", self.cameras, n)
        if problem is None and self.metadata and len(self.metadata) not in (1, n):
            problem = (f"{len(self.metadata)} metadata fields for {n} images: send one per "
                       "image or one for all")
        if problem is not None:
            raise ValueError(problem)
        return self

    def metadata_per_image(self) -> list[dict[str, Any] | None]:
        """One metadata object (or ``None``) per image, in order."""
        if not self.metadata:
            return [None] * len(self.images)
        return self.metadata * len(self.images) if len(self.metadata) == 1 else self.metadata
