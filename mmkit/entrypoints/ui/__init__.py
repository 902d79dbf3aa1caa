"""The playground page of `mmkit serve`: one static chat page over the server's own API.

`mount_ui(app)` adds `GET /` (index.html) and `GET /ui/app.js`, `GET /ui/style.css` to a
FastAPI app. The page is plain HTML, CSS and JavaScript shipped as package data: no build
step, no framework, nothing fetched from elsewhere (the Content-Security-Policy below lets
the page talk to its own server only). The page calls `/v1/models` (a 401 there tells it an
API key is needed) and `/v1/chat/completions` with `stream: true`.

Stable `data-testid` hooks for browser tests: `image-input`, `prompt`, `send`, `stop`,
`new-chat`, `temperature`, `max-tokens`, `api-key` (present only while a key is asked for),
`assistant-message` (one per answer, holding its text), `stats` (one per answer; its
`data-tokens`, `data-ttft-ms` and `data-tokens-per-second` attributes hold the figures) and
`error`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The folder holding index.html, app.js and style.css.
UI_DIR = Path(__file__).parent

#: Public paths -> (file, media type). Nothing else in this folder is served.
UI_FILES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}

# Own origin only: a page that works offline by construction. `data:`/`blob:` images are the
# user's own previews.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def mount_ui(app: Any) -> None:
    """Serve the playground page at `/` (and its two assets under `/ui/`) on a FastAPI `app`.

    These routes need no API key: the page itself asks for one when the API answers 401.
    """
    from fastapi.responses import Response

    def route(filename: str, media_type: str):
        def serve() -> Response:
            # Read per request: small files, and an edited page shows up on reload.
            return Response((UI_DIR / filename).read_bytes(), media_type=media_type, headers=_HEADERS)

        serve.__name__ = f"ui_{filename.replace('.', '_')}"
        return serve

    for path, (filename, media_type) in UI_FILES.items():
        app.add_api_route(path, route(filename, media_type), methods=["GET", "HEAD"], include_in_schema=False)
