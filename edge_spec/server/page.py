"""The chat page: ``GET /`` and its files under ``/static/`` (``edge_spec/server/static/``, shipped in the package).

Plain HTML, CSS and JavaScript, no build step and nothing fetched from elsewhere: the page talks to this
server only (same origin, so the guard lets its requests through like any local client's), streams
``/v1/chat/completions`` with ``x_edge_spec.provenance`` and colours every token by its source.  The
page is static: it needs no API key, and asks its user for one when the API does.

Its responses forbid what a page showing model output should never do: scripts, styles, connections and
images from anywhere but this server, inline scripts, being framed by another site, sending a referrer.
"""

from __future__ import annotations

from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response

STATIC = Path(__file__).with_name("static")
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


async def chat_page(request: Request) -> Response:
    return _file("index.html")


async def page_file(request: Request) -> Response:
    return _file(request.path_params["name"])


def _file(name: str) -> Response:
    """A file of the page by its bare name (no paths: ``/static/{name}`` matches no slash), else 404."""
    path = STATIC / name
    media_type = MEDIA_TYPES.get(path.suffix)
    if media_type is None or name.startswith(".") or not path.is_file():
        raise HTTPException(404, "Not Found")
    return FileResponse(path, media_type=media_type, headers=PAGE_HEADERS)
