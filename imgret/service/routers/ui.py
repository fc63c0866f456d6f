"""GET /: the web page (static HTML + JS served from imgret/service/static)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

router = APIRouter(tags=["ui"])

_INDEX = Path(__file__).resolve().parent.parent / "static" / "index.html"


@router.get("/", response_class=FileResponse, include_in_schema=False)
def read_index_page() -> FileResponse:
    """The search page: upload or drop an image, browse its neighbours."""
    return FileResponse(_INDEX, media_type="text/html")
