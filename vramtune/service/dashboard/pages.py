"""The dashboard's pages and assets, served by the service itself (no CDN, no build step).

The pages carry no data: their scripts fetch it from the JSON endpoints with the user's token,
so the HTML and the assets are public. Plots are drawn by plot.js on a canvas: plotly.js (4.8 MB)
took over 2 s of CPU to load on this 2-core machine before drawing anything.
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from pathlib import Path
from string import Template

from fastapi import APIRouter, Request, Response

router = APIRouter(include_in_schema=False)

ASSET_DIR = files("vramtune.service") / "static" / "dashboard"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Nothing inline, no eval: scripts and styles come from these files only (the scripts set
# element.style properties, which CSP allows, never style attributes).
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'self'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


@dataclass(frozen=True)
class Asset:
    """A file kept in memory with its gzip form and a strong ETag."""

    body: bytes
    gzipped: bytes
    etag: str
    media_type: str


@dataclass(frozen=True)
class PageSpec:
    """A page: its title, its own script, whether it draws plots."""

    title: str
    script: str
    plots: bool = False


PAGES = {
    "studies": PageSpec("Studies", "studies.js"),
    "study": PageSpec("Study", "study.js", plots=True),
    "fleet": PageSpec("Fleet", "fleet.js"),
}


def _script(name: str, mode: str) -> str:
    """A script tag; its id is the file name with dashes ("plot-js")."""
    tag_id = name.replace(".", "-")
    return f'  <script id="{tag_id}" src="/dashboard/static/{name}" {mode}></script>'


def render_page(page: str) -> bytes:
    """The page's HTML: the shared shell around its own <main> (no data: scripts fetch it)."""
    spec = PAGES[page]
    scripts = [_script("common.js", "defer")]
    scripts += [_script("plot.js", "defer")] if spec.plots else []
    scripts += [_script(spec.script, "defer")]
    shell = Template((ASSET_DIR / "shell.html").read_text())
    html = shell.substitute(
        title=spec.title,
        page=page,
        scripts="\n".join(scripts),
        main=(ASSET_DIR / f"{page}.main.html").read_text(),
    )
    return html.encode()


@cache
def shipped_names() -> frozenset[str]:
    """Every name the static route serves: the pages, and the assets shipped beside them."""
    assets = {
        entry.name
        for entry in ASSET_DIR.iterdir()
        if entry.is_file() and Path(entry.name).suffix in MEDIA_TYPES
        if not entry.name.endswith(".html")
    }
    return frozenset(assets | {f"{page}.html" for page in PAGES})


def asset(name: str) -> Asset | None:
    """The named asset (read once), None for any name that is not a shipped file.

    Names are checked against the shipped set before anything touches the file system or the
    cache: a 300-character name made ``is_file`` raise "File name too long" (a 500), and
    caching every name asked for let anyone grow the cache without a bound.
    """
    return _load(name) if name in shipped_names() else None


@cache  # keyed by shipped names only (see asset), so bounded by them
def _load(name: str) -> Asset:
    if name.endswith(".html"):
        body = render_page(name.removesuffix(".html"))
    else:
        body = (ASSET_DIR / name).read_bytes()
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    return Asset(body, gzip.compress(body, 6, mtime=0), etag, MEDIA_TYPES[Path(name).suffix])


def serve(request: Request, name: str) -> Response:
    """The asset, gzipped when the client takes it, 304 when the client has it, else 404."""
    found = asset(name)
    if found is None:
        return Response(
            status_code=404, content=b'{"detail":"no such file"}', media_type="application/json"
        )
    # no-cache: revalidated by ETag, so that a new release shows at once.
    headers = {"ETag": found.etag, "Cache-Control": "no-cache", "Vary": "Accept-Encoding"}
    if found.media_type.startswith("text/html"):
        headers.update(SECURITY_HEADERS)
    if request.headers.get("if-none-match") == found.etag:
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        headers["Content-Encoding"] = "gzip"
        return Response(found.gzipped, media_type=found.media_type, headers=headers)
    return Response(found.body, media_type=found.media_type, headers=headers)


@router.get("/")
def studies_page(request: Request) -> Response:
    """The studies page."""
    return serve(request, "studies.html")


@router.get("/studies/{name:path}")
def study_page(request: Request, name: str) -> Response:
    """One study's page (the script reads the name from the URL)."""
    return serve(request, "study.html")


@router.get("/fleet")
def fleet_page(request: Request) -> Response:
    """The fleet page."""
    return serve(request, "fleet.html")


@router.get("/dashboard/static/{name}")
def static_file(request: Request, name: str) -> Response:
    """A script, style sheet or image of the dashboard."""
    return serve(request, name)
