"""The dashboard's static page: HTML, JS and CSS shipped in the package, plus plotly.js from the
installed ``plotly`` package (the machines are offline: never a CDN). The server and the router
serve the same page; only its JSON (``GET /v1/cache/dashboard``) differs.

The page carries no data and needs no key. ``/dashboard/config.json`` tells it whether the JSON needs
one, so a page without a key shows the "needs an API key" message instead of provoking a 401 (which
the browser logs as a console error).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response

STATIC_DIR = Path(__file__).parent / "static"
POLL_MS = 1500

# Prompt text is drawn with textContent, and this keeps any script or frame not from this origin out.
# Plotly adds its own <style> elements, hence 'unsafe-inline' for styles (never for scripts).
_PAGE_HEADERS = {
    "Content-Security-Policy": ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; "
                                "base-uri 'none'; form-action 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_ASSET_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
# plotly.min.js is ~5 MB and only changes with the installed package: let the browser keep it a day.
_LIBRARY_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "public, max-age=86400"}


def plotly_js_path() -> Path:
    """plotly.min.js as the ``plotly`` PyPI package ships it (found without importing plotly)."""
    spec = importlib.util.find_spec("plotly")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "package_data" / "plotly.min.js"
        if path.is_file():
            return path
    raise FileNotFoundError("plotly.min.js not found: the dashboard needs the 'plotly' package (pip install plotly)")


@dataclass(frozen=True)
class PageConfig:
    """What the page learns before it fetches any data. ``auth_required`` is None where the answer is
    not known up front (the router: its backends decide)."""

    kind: str  # "server" or "router"
    auth_required: Callable[[], bool | None]


def dashboard_page_router(config: PageConfig) -> APIRouter:
    router = APIRouter()

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    @router.get("/dashboard/dashboard.js", include_in_schema=False)
    async def script() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.js", media_type="text/javascript; charset=utf-8",
                            headers=_ASSET_HEADERS)

    @router.get("/dashboard/dashboard.css", include_in_schema=False)
    async def style() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.css", media_type="text/css; charset=utf-8", headers=_ASSET_HEADERS)

    @router.get("/dashboard/plotly.min.js", include_in_schema=False)
    async def plotly() -> Response:
        try:
            path = plotly_js_path()
        except FileNotFoundError as error:
            # The page still shows its numbers and tables without charts.
            return JSONResponse({"error": {"message": str(error)}}, status_code=404)
        return FileResponse(path, media_type="text/javascript; charset=utf-8", headers=_LIBRARY_HEADERS)

    @router.get("/dashboard/config.json", include_in_schema=False)
    async def page_config() -> JSONResponse:
        return JSONResponse({"kind": config.kind, "auth_required": config.auth_required(), "poll_ms": POLL_MS},
                            headers={"Cache-Control": "no-store"})

    return router
