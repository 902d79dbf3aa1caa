"""The playground's files as `mmkit serve` ships them (no browser needed; see test_ui_browser.py).

The app is built in-process with `create_app` (routes only: these requests never reach an
engine) and called through FastAPI's TestClient: `/` and its assets with their types, `--no-ui`,
`--api-key` (the page itself needs no key; the API does), package data, and no reference to
any other host.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from mmkit.entrypoints.openai.api_server import UI_DIR, create_app  # noqa: E402
from mmkit.entrypoints.openai.serving_engine import ServerConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
UI_FILES = ("index.html", "app.js", "api.js", "attachment.js", "style.css")
TEST_IDS = ("image-input", "prompt", "send", "stop", "new-chat", "temperature", "max-tokens", "api-key", "error")


def _client(api_key=None, enable_ui=True) -> TestClient:
    config = ServerConfig(served_model_names=("default-model",), max_model_len=512, api_key=api_key)
    return TestClient(create_app(object(), config, enable_ui=enable_ui))  # no engine call here


def test_page_and_assets_are_served_with_their_types():
    client = _client()
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for testid in TEST_IDS:
        assert f'data-testid="{testid}"' in page.text, testid
    # The script builds one `assistant-message` and one `stats` element per answer.
    for name in ("app.js", "api.js", "attachment.js"):  # ES modules: a JavaScript type is required
        script = client.get(f"/{name}")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"], name
    script = client.get("/app.js").text
    assert '"assistant-message"' in script and '"stats"' in script
    style = client.get("/style.css")
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")
    assert client.get("/missing.js").status_code == 404


def test_no_ui_turns_the_page_off():
    client = _client(enable_ui=False)
    for path in ("/", *(f"/{name}" for name in UI_FILES[1:])):
        response = client.get(path)
        assert response.status_code == 404, path
        assert "error" in response.json()


def test_with_an_api_key_the_page_loads_and_the_api_answers_401():
    client = _client(api_key="k-123")
    for path in ("/", *(f"/{name}" for name in UI_FILES[1:])):
        assert client.get(path).status_code == 200, path
    # The page learns that a key is needed from this 401 (app.js: connect()).
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_the_page_uses_no_other_host():
    for name in UI_FILES:
        text = (UI_DIR / name).read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), name
        assert "@import" not in text and "fonts.googleapis" not in text
    # test_ui_browser.py checks it in the browser too: every request goes to the server.


def test_the_page_ships_as_package_data():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["mmkit.entrypoints"]
    shipped = {p.name for pattern in patterns for p in (REPO / "mmkit" / "entrypoints").glob(pattern)}
    assert set(UI_FILES) <= shipped
    assert "mmkit.entrypoints" in config["tool"]["setuptools"]["packages"]
