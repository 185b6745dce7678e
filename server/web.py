"""The chat page ``serve`` shows at ``/``: static files shipped in the package, no build step.

The page (``static/``) talks to this server's own ``/v1`` routes, streams answers from
``/v1/chat/completions`` and keeps its conversations in the browser's local storage; the server keeps
nothing for it. Model text reaches the page only as data: it is rendered through a sanitizer, and the
Content-Security-Policy below forbids inline and foreign scripts in case that ever fails.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The page is a few small files: always revalidate, so an upgraded package serves its new page.
    "Cache-Control": "no-cache",
}


class _StaticFiles(StaticFiles):
    async def get_response(self, path: str, scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


async def index(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers=SECURITY_HEADERS)


def routes() -> list[BaseRoute]:
    """``GET /`` (the page) and ``/static/*`` (its scripts, styles and vendored libraries)."""
    return [
        Route("/", index, methods=["GET", "HEAD"]),
        Mount("/static", app=_StaticFiles(directory=STATIC_DIR), name="static"),
    ]
