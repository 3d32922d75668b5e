"""The dashboard at /dashboard, opened in headless Chromium (the system's browser, driven by playwright) on a
deployment of simulated components on the default backend; and what its routes give without a browser."""

from __future__ import annotations

import json
import shutil
import threading
import time
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


# -- a pipeline with typed inputs: the form built from its JSON Schema -------------------------------------------
tagger = Simulated(5, output=lambda text: {}["boom"] if text == "boom" else f"Tagged {text}")  # "boom": a KeyError
waiter = Simulated(3000, output="waited")  # called for a negative topk only: past the request timeout


def typed() -> dict[str, Any]:
    question = "What is a list?"
    topk = 3
    items = ["a", "b"]
    loud = False
    with patchkit.capture():
        text = tagger.run(question)
        if topk < 0:
            text = waiter.run(text)
        return {"topk2": topk * 2, "count": len(items), "text": text.upper() if loud else text}


@pytest.fixture(scope="module")
def typed_endpoint() -> Iterator[patchkit.Endpoint]:
    typed()
    with patchkit.deploy({"typed": patchkit.last_pipeline()}, optional_inputs=("loud",), request_timeout_s=1.0) as served:
        yield served


def test_the_pipelines_route_publishes_each_pipelines_input_schema(typed_endpoint: patchkit.Endpoint) -> None:
    [row] = httpx.get(typed_endpoint.url + "/v1/pipelines").json()["pipelines"]
    assert row["input_schema"] == {
        "type": "object", "additionalProperties": False, "required": ["items", "question", "topk"],
        "properties": {"question": {"type": "string"}, "topk": {"type": "integer"}, "items": {"type": "array"},
                       "loud": {"type": "boolean", "default": False}}}


@needs_browser
def test_the_form_sends_integers_lists_and_booleans_as_the_schema_types_them(
    typed_endpoint: patchkit.Endpoint, page: Page
) -> None:
    page.goto(typed_endpoint.url + "/dashboard")
    topk = page.locator("#inputs [data-input=topk]")
    expect(topk).to_have_attribute("type", "number", timeout=20_000)
    expect(page.locator("#inputs [data-input=loud]")).to_have_attribute("type", "checkbox")
    expect(page.locator("#inputs textarea[data-input=items]")).to_have_count(1)
    page.fill("#inputs [data-input=question]", "typed")
    topk.fill("4")
    page.fill("#inputs [data-input=items]", '["x", {"y": 1}, [2, 3]]')
    page.check("#inputs [data-input=loud]")
    page.click("#send")
    expect(page.locator("#answer[data-done=true]")).to_be_visible(timeout=30_000)
    assert json.loads(page.inner_text("#answer")) == {"topk2": 8, "count": 3, "text": "TAGGED TYPED"}
    expect(page.locator("#outcome")).to_contain_text("answered in")


@needs_browser
def test_a_field_that_is_not_its_type_says_why_and_nothing_is_sent(typed_endpoint: patchkit.Endpoint, page: Page) -> None:
    queries: list[str] = []
    page.on("request", lambda request: queries.append(request.url) if request.url.endswith("/query") else None)
    page.goto(typed_endpoint.url + "/dashboard")
    expect(page.locator("#inputs [data-input=topk]")).to_be_visible(timeout=20_000)
    page.fill("#inputs [data-input=question]", "typed")
    page.fill("#inputs [data-input=topk]", "2.5")
    page.fill("#inputs [data-input=items]", '["x", ')
    page.click("#send")
    expect(page.locator("[data-error-for=topk]")).to_have_text("topk must be an integer (a whole number such as 3); got 2.5")
    expect(page.locator("[data-error-for=items]")).to_contain_text("items is not valid JSON")
    expect(page.locator("#inputs [data-input=topk]")).to_have_attribute("aria-invalid", "true")
    page.fill("#inputs [data-input=items]", '{"x": 1}')
    page.click("#send")
    expect(page.locator("[data-error-for=items]")).to_have_text('items must be a JSON list, like ["a", 2]')
    assert page.inner_text("#answer") == ""
    page.fill("#inputs [data-input=topk]", "2")
    page.fill("#inputs [data-input=items]", "[]")
    page.click("#send")
    expect(page.locator("#answer[data-done=true]")).to_be_visible(timeout=30_000)
    expect(page.locator("[data-error-for=topk]")).to_have_text("")
    assert len(queries) == 1 and '"topk2": 4' in page.inner_text("#answer")  # the one click with no wrong field


@needs_browser
def test_every_failed_outcome_is_counted_as_failed(typed_endpoint: patchkit.Endpoint, page: Page) -> None:
    query = typed_endpoint.url + "/v1/pipelines/typed/query"
    given = {"topk": 1, "items": []}
    assert httpx.post(query, json={"inputs": {**given, "question": "boom"}}).status_code == 500  # an error
    late = httpx.post(query, json={"inputs": {**given, "question": "late", "topk": -1}}, timeout=30)
    assert late.status_code == 504  # past request_timeout_s
    outcomes = httpx.get(typed_endpoint.url + "/v1/stats").json()["requests"]
    failed = sum(count for outcome, count in outcomes.items() if outcome not in ("ok", "inflight", "mean_latency_ms"))
    assert outcomes["error"] >= 1 and outcomes["timeout"] >= 1
    page.goto(typed_endpoint.url + "/dashboard")
    row = page.locator("#slo dd[data-row=failed]")
    expect(row).to_contain_text(f"{failed} (", timeout=20_000)
    expect(row).to_contain_text("timeout 1")
    expect(row).to_contain_text("error")
    expect(page.locator("#p50-label")).to_have_text("p50 ms (last 50 requests)")


# -- how the page reads and refreshes ----------------------------------------------------------------------------
SLOW_ACTIVITY = """
window.activityFetches = { active: 0, most: 0, started: 0 };
const plainFetch = window.fetch;
window.fetch = async (url, options) => {
  if (!String(url).includes("v1/activity")) return plainFetch(url, options);
  const seen = window.activityFetches;
  seen.started += 1; seen.active += 1; seen.most = Math.max(seen.most, seen.active);
  try {
    const reply = await plainFetch(url, options);
    await new Promise((resolve) => setTimeout(resolve, 2500));  // a refresh slower than the refresh period
    return reply;
  } finally { seen.active -= 1; }
};
"""


@needs_browser
def test_a_slow_refresh_is_not_overlapped_by_the_next(endpoint: patchkit.Endpoint, page: Page) -> None:
    page.add_init_script(SLOW_ACTIVITY)
    page.goto(endpoint.url + "/dashboard")
    page.wait_for_function("window.activityFetches.started >= 2", timeout=20_000)
    assert page.evaluate("window.activityFetches.most") == 1


# The agreed stream format: named step events, JSON previews, named error, and `event: end` last; a step's data
# split over two data lines, "\r\n" line ends, a comment, and an event after the end (never shown).
STREAM_OK = (
    ': steps follow\n'
    'event: step\ndata: {"step": {"phase": "start", "call": 0, "node": "n1", "component": "retriever", '
    '"method": "run", "at_ms": 0.2}}\n\n'
    'event: step\r\ndata: {"step": {"phase": "end", "call": 0, "node": "n1", "component": "retriever", "method": "run",\r\n'
    'data: "at_ms": 9.1, "batch": 2, "replica": "retriever#0", "wait_ms": 1.5, "duration_ms": 8.9,\r\n'
    'data: "preview": ["a page", {"score": 0.5}], "preview_truncated": true}}\r\n\r\n'
    'data: {"delta": "Hel"}\n\ndata: {"delta": "lo"}\n\n'
    'data: {"output": {"text": "Hello", "n": 2}, "request_id": "req-1", "latency_ms": 12.5}\n\n'
    'event: end\ndata: {"request_id": "req-1", "status": "ok"}\n\n'
    'data: {"delta": " after the end"}\n\n'
)
STREAM_ERROR = (
    'event: step\ndata: {"step": {"phase": "end", "call": 0, "node": "n1", "component": "llm", "method": "run", '
    '"at_ms": 3, "batch": 1, "replica": "llm#0", "wait_ms": 0, "duration_ms": 3, "sensitive": true}}\n\n'
    'event: error\ndata: {"error": {"type": "ValueError", "message": "no such page"}, "request_id": "req-2"}\n\n'
    'event: end\ndata: {"request_id": "req-2", "status": "error"}\n\n'
)
READ = """async ([text, size]) => {
  const bytes = new TextEncoder().encode(text);
  const body = new ReadableStream({ start(controller) {
    for (let at = 0; at < bytes.length; at += size) controller.enqueue(bytes.slice(at, at + size));
    controller.close();
  } });
  document.getElementById("steps").replaceChildren();
  document.getElementById("answer").textContent = "";
  delete document.getElementById("outcome").dataset.state;
  await readReply(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
}"""


@needs_browser
def test_the_page_reads_named_step_error_and_end_events(endpoint: patchkit.Endpoint, page: Page) -> None:
    page.goto(endpoint.url + "/dashboard")
    expect(page.locator("#components tr[data-component=retriever]")).to_have_count(1, timeout=20_000)
    for size in (7, 4096):  # events cut anywhere between reads, and whole
        page.evaluate(READ, [STREAM_OK, size])
        steps = page.locator("#steps li.step")
        expect(steps).to_have_count(2)
        ended = steps.nth(1).inner_text()
        assert "retriever.run ended: 8.9 ms, waited 1.5 ms, batch 2 on retriever#0" in ended
        assert ended.endswith('["a page",{"score":0.5}] …'), ended
        assert page.inner_text("#answer") == '{\n  "text": "Hello",\n  "n": 2\n}'
        assert page.inner_text("#outcome") == "answered in 12.5 ms (request req-1)"
    page.evaluate(READ, [STREAM_ERROR, 5])
    assert "(sensitive: no preview)" in page.inner_text("#steps")
    assert page.inner_text("#outcome") == "ValueError: no such page (request req-2)"
    assert page.get_attribute("#outcome", "data-state") == "error"


# -- a rolling update: the version retiring is named in its pipeline's card, which is listed once -----------------
slow = Simulated(4000, output="a slow answer")


def slow_answer() -> str:
    question = "Which version?"
    with patchkit.capture():
        return slow.run(question)  # type: ignore[no-any-return]


@needs_browser
def test_a_pipeline_updated_while_a_request_runs_is_listed_once(page: Page) -> None:
    slow_answer()
    with patchkit.deploy({"slow": patchkit.last_pipeline()}) as served:
        running = threading.Thread(target=served["slow"].query, kwargs={"question": "on version 1"})
        running.start()
        try:
            page.goto(served.url + "/dashboard")
            expect(page.locator("#pipeline option")).to_have_count(1, timeout=20_000)
            deadline = time.monotonic() + 10
            while not any(row["inflight"] for row in served.pipelines()) and time.monotonic() < deadline:
                time.sleep(0.05)
            served.update(patchkit.last_pipeline())
            assert [row["state"] for row in served.pipelines()] == ["ready", "retiring"]
            card = page.locator("#pipelines .pipeline")
            expect(card.locator(".versions")).to_have_text("version 1 retiring, 1 in flight", timeout=10_000)
            expect(card).to_have_count(1)
            expect(card.locator("h3")).to_contain_text("version 2")
            expect(page.locator("#pipeline option")).to_have_count(1)
        finally:
            running.join()
