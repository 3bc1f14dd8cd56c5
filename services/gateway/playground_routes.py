"""The browser playground: one static page and its script (services/gateway/playground/), served at
/playground. The page talks to this gateway's /v1/models and streamed /v1/chat/completions."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

PLAYGROUND = Path(__file__).resolve().parent / "playground"

router = APIRouter(include_in_schema=False)


@router.get("/playground")
async def playground_page() -> FileResponse:
    return FileResponse(PLAYGROUND / "index.html", media_type="text/html")


@router.get("/playground/playground.js")
async def playground_script() -> FileResponse:
    return FileResponse(PLAYGROUND / "playground.js", media_type="text/javascript")
