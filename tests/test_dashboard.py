"""The dashboard at /dashboard, opened in headless Chromium (the system's browser, driven by playwright) on a
deployment of simulated components on the default backend; and what its routes give without a browser."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from components import Streamer

import patchkit
from patchkit.components.testing import Simulated

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import Page, expect, sync_playwright
except ImportError:  # the dev extra installs it
    sync_playwright = None
needs_browser = pytest.mark.skipif(
    CHROMIUM is None or sync_playwright is None,
    reason="needs the system's Chromium (apt-get install chromium; .ci/run installs it) and playwright (the dev extra)")

TOKEN = "dashboard-token-8c1f"
retriever = Simulated(20, output=lambda q: [f"a page about {q}", "the tutorial"])
llm = Streamer()


def answer() -> str:
    question = "How do I read a file?"
    with patchkit.capture():
        docs = retriever.run(question)
        return llm.generate(question + " " + docs[1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[patchkit.Endpoint]:
    answer()
    with patchkit.deploy({"answer": patchkit.last_pipeline()}) as served:
        yield served


@pytest.fixture(scope="module")
def guarded() -> Iterator[patchkit.Endpoint]:
    answer()
    with patchkit.deploy({"answer": patchkit.last_pipeline()}, auth_token=TOKEN) as served:
        yield served


@pytest.fixture
def page() -> Iterator[Page]:
    assert sync_playwright is not None and CHROMIUM is not None
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 1400})
        finally:
            browser.close()


def ask(page: Page, question: str) -> None:
    """Send `question` through the page's form and wait for its answer."""
    page.fill("#inputs input[data-input=question]", question)
    page.click("#send")
    expect(page.locator("#answer[data-done=true]")).to_be_visible(timeout=30_000)


def test_the_page_is_linked_from_the_home_page_and_guards_its_data(guarded: patchkit.Endpoint) -> None:
    home = httpx.get(guarded.url + "/")
    assert home.status_code == 200 and 'href="dashboard"' in home.text
    for path in ("/dashboard", "/dashboard/app.js", "/dashboard/style.css"):
        assert httpx.get(guarded.url + path).status_code == 200, path
    assert "text/javascript" in httpx.get(guarded.url + "/dashboard/app.js").headers["content-type"]
    for path in ("/v1/activity", "/v1/pipelines/answer/graph.svg", "/v1/stats", "/dashboard/secrets.txt"):
        assert httpx.get(guarded.url + path).status_code == 401, path
    auth = {"Authorization": f"Bearer {TOKEN}"}
    svg = httpx.get(guarded.url + "/v1/pipelines/answer/graph.svg", headers=auth)
    assert svg.status_code == 200 and svg.headers["content-type"].startswith("image/svg+xml") and "<svg" in svg.text
    missing = httpx.get(guarded.url + "/v1/pipelines/nope/graph.svg", headers=auth)
    assert missing.status_code == 404 and "answer" in missing.json()["error"]["message"]
    # every URL the page uses is relative, so that it works under a proxy's path
    page = httpx.get(guarded.url + "/dashboard").text + httpx.get(guarded.url + "/dashboard/app.js").text
    assert 'src="/' not in page and 'href="/' not in page and '"/v1' not in page and "http" not in page.replace("https://", "")


@needs_browser
def test_a_question_sent_from_the_dashboard_shows_its_steps_and_answer(
    endpoint: patchkit.Endpoint, page: Page, tmp_path: Path
) -> None:
    page.goto(endpoint.url + "/dashboard")
    expect(page.locator("#pipelines img[src^='blob:']")).to_have_count(1, timeout=20_000)  # the graph, drawn
    expect(page.locator("#components tr[data-component=retriever]")).to_contain_text("retriever#0: serving")
    ask(page, "What is a context manager?")
    steps = page.locator("#steps li.step")
    expect(steps).to_have_count(4)
    phases: list[Any] = [steps.nth(i).get_attribute("data-phase") for i in range(4)]
    assert phases == ["start", "end", "start", "end"]
    assert "retriever.run" in steps.nth(1).inner_text() and "batch 1" in steps.nth(1).inner_text()
    assert "What is a context manager?" in page.inner_text("#answer")
    expect(page.locator("#requests .bar")).not_to_have_count(0, timeout=10_000)  # its timeline
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_browser
def test_the_dashboard_asks_for_the_token_and_then_works(guarded: patchkit.Endpoint, page: Page) -> None:
    page.goto(guarded.url + "/dashboard")
    expect(page.locator("#token-form")).to_be_visible(timeout=20_000)
    expect(page.locator("#pipelines img")).to_have_count(0)
    page.fill("#token", "wrong")
    page.click("#token-form button")
    expect(page.locator("#token-form")).to_be_visible(timeout=10_000)
    page.fill("#token", TOKEN)
    page.click("#token-form button")
    expect(page.locator("#pipelines img[src^='blob:']")).to_have_count(1, timeout=20_000)
    ask(page, "What is a set?")
    expect(page.locator("#steps li.step")).to_have_count(4)
