"""The A/B playground page end to end in a real browser.

Headless Chromium (the system's ``chromium``, driven by Playwright's Python package; Playwright
never downloads a browser here) loads GET / from a server this test starts on the tiny model,
with the target as its own draft: side A speculates, side B decodes plainly. Greedy, so both
texts must equal the offline engine's; the speculative side must mark accepted-draft text. A
second, long run is cancelled from the page and the server must drop to 0 requests in flight
with every KV block free. Screenshots at 1280x800 and at phone width; with
``SPECSERVE_SCREENSHOTS=docs`` the desktop one replaces docs/playground.png (the README's).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from specserve.server.server_config import ServerConfig
from tests.helpers.servers import HANG_S, KEY, ServerThread, engine_config, http, reference

CHROMIUM = (os.environ.get("SPECSERVE_CHROMIUM") or shutil.which("chromium")
            or shutil.which("chromium-browser"))
NO_CHROMIUM = ("no Chromium on PATH (Debian: apt-get install chromium; `make test` installs it "
               "when run as root or with sudo; SPECSERVE_CHROMIUM=/path/to/chrome also works)")
if CHROMIUM is None and os.environ.get("SPECSERVE_REQUIRE_BROWSER") == "1":  # .ci/run sets it
    raise RuntimeError(NO_CHROMIUM + ", but SPECSERVE_REQUIRE_BROWSER=1")
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is a dev dependency: pip install -e '.[dev]'")
pytestmark = [pytest.mark.browser, pytest.mark.e2e,
              pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)]
PROMPT = "The little robot walked into the"
HANG_MS = HANG_S * 1000  # Playwright waits in ms; only a hang runs out
DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(
        engine_config(model_dir, draft_model=model_dir, speculative_method="draft",
                      adaptive_speculation=False, num_speculative_tokens=4,
                      max_model_len=512),
        ServerConfig(port=0, api_key=KEY, served_model_name="tiny-llama"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM)
        pg = browser.new_page(viewport={"width": 1280, "height": 800})
        console: list[str] = []
        pg.on("pageerror", lambda exc: console.append(str(exc)))
        pg.goto(server.url + "/")
        pg.fill("#api-key", KEY)
        pg.dispatch_event("#api-key", "change")  # the info needs the key, like /v1
        sync_api.expect(pg.locator("#model-line")).to_contain_text("tiny-llama")
        yield pg
        assert not console, console  # no uncaught JavaScript errors
        browser.close()


def _settings(pg, max_tokens: int, method_a: str = "draft", k_a: str = "4") -> None:
    pg.check("input[name=kind][value=completion]")
    pg.fill("#prompt", PROMPT)
    pg.fill("#max-tokens", str(max_tokens))
    pg.fill("#temperature", "0")
    pg.check("#ignore-eos")
    pg.select_option("#method-a", method_a)
    pg.fill("#k-a", k_a)
    pg.select_option("#method-b", "off")


def _wait_idle(url: str) -> dict:
    deadline = time.monotonic() + HANG_S  # only a hang ends the wait
    while True:
        h = http("GET", url + "/health")[1]
        idle = (h["num_in_flight"] == 0 and h["num_running"] == 0
                and h["kv_blocks_free"] == h["kv_blocks_total"])
        if idle or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def test_ab_run_greedy_equal_and_acceptance_marked(page, server, offline, tmp_path):
    want = reference(offline, [PROMPT], 48, ignore_eos=True)[0].text
    _settings(page, 48)
    page.click("#run")
    for side in ("a", "b"):
        sync_api.expect(page.locator(f"#panel-{side}")).to_have_attribute(
            "data-state", "done", timeout=HANG_MS)
    text_a = page.inner_text("#panel-a [data-out]")
    text_b = page.inner_text("#panel-b [data-out]")
    assert text_a == text_b == want
    # Side A marks accepted drafts (the target is its own draft: all of them are accepted);
    # the plain side marks none, and the marked pieces are pieces of the real text.
    drafted = page.locator("#panel-a [data-out] .tok-draft").all_inner_texts()
    assert drafted and all(piece in want for piece in drafted)
    assert page.locator("#panel-b [data-out] .tok-draft").count() == 0
    assert page.inner_text("#panel-a [data-stat=rate]") == "100.0%"
    assert page.inner_text("#panel-b [data-stat=rate]") == "–"
    assert float(page.inner_text("#panel-a [data-stat=mal]")) > 1.0
    assert page.get_attribute("#summary", "data-speedup")  # both finished: a ratio is shown
    assert "Texts identical" in page.inner_text("#summary")
    page.screenshot(path=str(tmp_path / "playground.png"))
    if os.environ.get("SPECSERVE_SCREENSHOTS") == "docs":
        DOCS.mkdir(exist_ok=True)
        page.screenshot(path=str(DOCS / "playground.png"))


def test_cancel_frees_the_server(page, server):
    _settings(page, 480)  # long enough that it is still running when Cancel lands
    page.click("#run")
    sync_api.expect(page.locator("#panel-a [data-stat=tokens]")).not_to_have_text(
        "0", timeout=HANG_MS)
    assert http("GET", server.url + "/health")[1]["num_in_flight"] >= 1
    page.click("#cancel")
    for side in ("a", "b"):
        sync_api.expect(page.locator(f"#panel-{side}")).to_have_attribute(
            "data-state", "cancelled", timeout=HANG_MS)
    h = _wait_idle(server.url)
    assert h["num_in_flight"] == 0 and h["num_running"] == 0, h
    assert h["kv_blocks_free"] == h["kv_blocks_total"], h
    assert page.is_enabled("#run") and not page.is_enabled("#cancel")


def test_server_error_shown_in_page(page, server):
    _settings(page, 8, k_a="99")  # num_tokens must be 0..16: the server answers an error
    page.click("#run")
    sync_api.expect(page.locator("#errors")).to_contain_text("speculative", timeout=HANG_MS)
    sync_api.expect(page.locator("#panel-a")).to_have_attribute("data-state", "error")
    sync_api.expect(page.locator("#panel-b")).to_have_attribute(
        "data-state", "done", timeout=HANG_MS)
    assert _wait_idle(server.url)["num_in_flight"] == 0


def test_phone_width_has_no_sideways_scroll(page, tmp_path):
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        overflow = page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0
        a, b = page.locator("#panel-a").bounding_box(), page.locator("#panel-b").bounding_box()
        assert b["y"] >= a["y"] + a["height"]  # stacked, not squeezed side by side
        page.screenshot(path=str(tmp_path / "playground-phone.png"), full_page=True)
    finally:
        page.set_viewport_size({"width": 1280, "height": 800})


def test_side_c_streams_another_openai_server(page, server, offline):
    # "Another server" is this one's own REST API (same origin, so no CORS in the way): side C
    # reads its SSE stream and must show the same greedy text as the WebSocket sides.
    want = reference(offline, [PROMPT], 24, ignore_eos=True)[0].text
    _settings(page, 24)
    page.check("#use-c")
    page.fill("#url-c", server.url)
    page.fill("#key-c", KEY)
    page.fill("#model-c", "")  # take the first of its /v1/models
    try:
        page.click("#run")
        for side in ("a", "b", "c"):
            sync_api.expect(page.locator(f"#panel-{side}")).to_have_attribute(
                "data-state", "done", timeout=HANG_MS)
        assert page.inner_text("#panel-c [data-out]") == want
        assert page.inner_text("#panel-c [data-stat=tokens]") == "24"  # from the final usage
        assert "B over C" in page.inner_text("#summary")
    finally:
        page.uncheck("#use-c")
