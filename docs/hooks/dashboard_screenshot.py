"""MkDocs hook (mkdocs.yml `hooks:`): a screenshot of the dashboard, made at build from a real deployment.

At each build a child process (this file run as a script) deploys a pipeline of `Simulated` components
on the default backend (worker processes), sends a few questions, opens `/dashboard` in the system's
headless Chromium through playwright (no browser download), asks a question through the page's form,
waits for its steps and answer, and saves a PNG. The picture goes into the built site
(`img/dashboard.png`), never into the repository; docs/dashboard.md's marker line becomes it.

Where Chromium or playwright is missing the site is still built: the page shows a note saying the
picture was not made and why, and the build log says so. A deployment or a page that fails where
both are present fails the build.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MARKER = "<!-- the dashboard's screenshot, made by docs/hooks/dashboard_screenshot.py -->"
IMAGE = "img/dashboard.png"
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300

log = logging.getLogger("mkdocs.hooks.dashboard_screenshot")
_made: dict[str, bytes | str] = {}  # "png": the picture, or "missing": why there is none


def chromium() -> str | None:
    """The system's Chromium, if installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def why_not() -> str | None:
    """Why no screenshot can be made here; None when it can."""
    if chromium() is None:
        return "Chromium is not installed where this site was built (`apt-get install chromium`)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed where this site was built (the dev extra)"
    return None


def screenshot() -> bytes | str:
    """The PNG, made in a child process; or why it could not be made."""
    missing = why_not()
    if missing is not None:
        return missing
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dashboard.png"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, __file__, str(out)]
        done = subprocess.run(command, env=env, cwd=ROOT, timeout=TIMEOUT_S, capture_output=True, text=True, check=False)  # noqa: S603
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the dashboard's screenshot failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return out.read_bytes()


def on_pre_build(config: Any) -> None:
    """Called by MkDocs before each build: the picture is made again."""
    _made.clear()


def on_files(files: Any, config: Any) -> Any:
    """Called by MkDocs once the documentation files are collected: the screenshot becomes a file of the site."""
    from mkdocs.structure.files import File

    made = _made.setdefault("png", screenshot())
    if isinstance(made, bytes):
        files.append(File.generated(config, IMAGE, content=made))
    else:
        log.info("no dashboard screenshot: %s", made)
    return files


def on_page_markdown(markdown_text: str, page: Any, config: Any, files: Any) -> str:
    """Called by MkDocs for every page before it is rendered: the marker line becomes the picture, or the note."""
    if MARKER not in markdown_text:
        return markdown_text
    made = _made.get("png")
    if isinstance(made, bytes):
        picture = f"![The dashboard of a deployment of simulated components, a question's steps and answer in its form]({IMAGE})"
    else:
        picture = f'!!! note "No screenshot in this build"\n    The picture was not made: {made}.'
    return markdown_text.replace(MARKER, picture)


# -- the child process: a deployment, a browser, a picture -------------------------------------------------
def _main(out: Path) -> None:
    import httpx
    from playwright.sync_api import expect, sync_playwright

    import patchkit
    from patchkit.components.testing import Simulated

    retriever = Simulated(40, output=["Exceptions are caught with try/except.", "finally always runs."])
    grader = Simulated(10, output=True)
    llm = Simulated([(1, 120), (8, 200)], output="Wrap the call in try: ... except ValueError as error: ...")

    def answer() -> str:
        question = "How do I catch an exception?"
        with patchkit.capture():
            docs = retriever.run(question)
            if grader.run(question + " " + docs[0]):
                docs = docs + retriever.run("Python " + question)
            return llm.run(question + " " + " ".join(docs))  # type: ignore[no-any-return]

    answer()
    with patchkit.deploy({"answer": patchkit.last_pipeline()}) as endpoint:
        for question in ("What is a generator?", "How do I open a file?", "What is a decorator?"):
            endpoint["answer"].query(question=question)
        assert httpx.get(endpoint.url + "/v1/activity").status_code == 200
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 1500})
            page.goto(endpoint.url + "/dashboard")
            expect(page.locator("#pipelines img[src^='blob:']")).to_have_count(1, timeout=30_000)
            page.fill("#inputs input[data-input=question]", "How do I catch an exception?")
            page.click("#send")
            expect(page.locator("#answer[data-done=true]")).to_be_visible(timeout=60_000)
            page.wait_for_timeout(2500)  # one refresh: the request's timeline drawn
            page.screenshot(path=str(out), full_page=True)
            browser.close()


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
