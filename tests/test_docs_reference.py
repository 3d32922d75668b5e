"""The built API reference shows what users call and nothing patchkit calls itself: the site is built (as
`mkdocs build` does, into a temporary directory) and its reference pages are read as a reader gets them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mkdocs", reason="the documentation site is built with MkDocs (the dev extra)")
pytest.importorskip("mkdocstrings", reason="the API reference is rendered by mkdocstrings (the dev extra)")

import patchkit  # noqa: E402
from patchkit.components import Augmenter, BM25Search, SpeculativeRetriever  # noqa: E402
from patchkit.core import make_methods  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Members that patchkit calls itself, by the class users know them from: none may be in the reference.
INTERNAL = {
    "Pipeline": ["run", "variables", "recorded_run", "absorb", "component_aliases", "fingerprint", "parallel"],
    "LlamaCppGenerator": ["tokens", "line", "bodies", "reuse_order", "profile_call"],
    "DeploymentConfig": ["check_options", "check_arguments", "resolve"],
    "errors": ["error_to_json", "error_from_json", "unknown_input"],
}
# What users hold, each with the members they read: each must have its own entry.
SHOWN = {
    "Graph": ["nodes", "edges", "overlap_groups", "to_svg", "to_mermaid", "to_json"],
    "Stream": ["output", "request_id"],
    "AsyncStream": ["output", "request_id", "aclose"],
    "Component": ["devices", "in_place", "setup"],
    "Stats": ["components", "requests"],
    "ComponentStats": ["replicas", "methods", "state"],
    "PlanReport": ["plan", "components"],
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    out = tmp_path_factory.mktemp("site")
    build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out)))
    return out


def _ids(site: Path, page: str) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', (site / page / "index.html").read_text()))


def _reference_ids(site: Path) -> set[str]:
    return {anchor for page in ("reference/api", "reference/errors", "reference/components", "reference/config")
            for anchor in _ids(site, page)}


def test_no_internal_name_is_in_the_built_reference(site: Path) -> None:
    anchors = _reference_ids(site)
    for owner, members in INTERNAL.items():
        for member in members:
            found = [a for a in anchors if a.endswith(f".{member}") and f"{owner}." in a or a == f"patchkit.errors.{member}"]
            assert not found, f"the reference shows {owner}.{member}: {found}"


def test_the_endpoint_shows_no_constructor_parameters(site: Path) -> None:
    page = (site / "reference" / "api" / "index.html").read_text()
    entry = page[page.index('id="patchkit.Endpoint"'):page.index('id="patchkit.Endpoint.query"')]
    text = re.sub(r"<[^>]+>", "", entry)
    assert "closer" not in text and "updater" not in text
    assert "Made by deploy()" in text


def _entry(page: str, owner: str) -> str:
    """The text of `owner`'s entry: from its heading to the next entry that is not one of its members."""
    anchors = [(m.start(), m[1]) for m in re.finditer(r'id="((?:patchkit\.)[\w.]+)"', page)]
    starts = [i for i, (_, anchor) in enumerate(anchors) if anchor.endswith(f".{owner}")]
    assert starts, f"no entry for {owner}"
    first = starts[0]
    mine = anchors[first][1]
    end = next((at for at, anchor in anchors[first + 1:] if not anchor.startswith(mine + ".")), len(page))
    return re.sub(r"<[^>]+>", " ", page[anchors[first][0]:end])


def test_what_users_hold_has_its_entry_and_members(site: Path) -> None:
    page = (site / "reference" / "api" / "index.html").read_text()
    for owner, members in SHOWN.items():
        entry = _entry(page, owner)
        for member in members:  # an entry of its own, or a row of its entry's attributes
            assert re.search(rf"\b{member}\b", entry), f"the entry of {owner} does not show {member}"


def test_every_error_says_its_http_status_or_that_it_is_never_sent(site: Path) -> None:
    from patchkit.server.replies import error_reply

    made: dict[str, Any] = {"ComponentError": patchkit.ComponentError("c", "m", "boom"),
                            "CallError": patchkit.CallError("c", "m", "boom"),
                            "Overloaded": patchkit.Overloaded(1, 1),
                            "PipelineNotFound": patchkit.PipelineNotFound("x")}
    for name in ("InputError", "WorkerDiedError", "ComponentFailed", "DeadlineExceeded", "ComponentError", "CallError",
                 "Overloaded", "PipelineNotFound"):
        error = made.get(name) or getattr(patchkit, name)("boom")
        status, _ = error_reply(error)
        doc = getattr(patchkit, name).__doc__
        assert re.search(rf"HTTP {status}\b", doc), f"{name} does not say its HTTP status ({status})"
        assert "Raised" in doc or "raised" in doc, f"{name} does not say when it is raised"
    for name in ("CaptureError", "PlanError"):
        assert "never over HTTP" in getattr(patchkit, name).__doc__


def test_the_read_only_methods_are_listed_from_the_code(site: Path) -> None:
    page = re.sub(r"<[^>]+>", "", (site / "parallel-calls" / "index.html").read_text())
    declared = page[page.index("Declared read_only=True:"):page.index("Not declared")]
    not_declared = page[page.index("Not declared"):]
    assert "BM25Search.search" in declared and "Augmenter.augment" in declared
    assert "SpeculativeRetriever.retrieve" in not_declared[:2000] and "SpeculativeRetriever" not in declared
    assert make_methods(BM25Search)["search"].read_only and make_methods(Augmenter)["augment"].read_only
    assert not make_methods(SpeculativeRetriever)["retrieve"].read_only


def test_the_http_reference_shows_the_openapi_document(site: Path) -> None:
    page = (site / "http-api" / "index.html").read_text()
    assert "openapi" in page and "/v1/chat/completions" in page and "<!-- the OpenAPI document" not in page


def test_every_patchkit_name_the_docs_write_is_importable_from_patchkit() -> None:
    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    written = {name for page in pages for name in re.findall(r"\bpatchkit\.([A-Z]\w+)", page.read_text())}
    assert "PipelineNotFound" in written
    missing = sorted(name for name in written if not hasattr(patchkit, name))
    assert not missing, f"the docs write patchkit.NAME for names patchkit does not export: {missing}"


def test_the_option_help_and_the_pages_tell_read_only_one_way() -> None:
    from patchkit.config import OPTIONS

    assert "@make(read_only=True)" in OPTIONS["parallel_calls"].option.help
    pages = {page.name: page.read_text() for page in sorted((ROOT / "docs").rglob("*.md"))}
    for name, text in pages.items():  # the old story: every independent call overlaps unless turned off
        assert not re.search(r"calls overlap unless\s+`?parallel_calls", text), name
    assert "Declaring `read_only`" in pages["parallel-calls.md"]
