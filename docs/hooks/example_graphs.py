"""MkDocs hook (mkdocs.yml `hooks:`): each example's pipeline graph, drawn as SVG when the site is built.

Every module of examples/ is loaded as `patchkit serve` loads a script (its `if __name__ == "__main__":`
block does not run) and every pipeline it holds at module level is drawn with `Graph.to_svg()`, which lays
the graph out itself (no Graphviz). The examples capture with `run=False`, so nothing is loaded or run: the
components are only constructed. The pictures go into the built site (`img/examples/*.svg`), never into the
repository; the Examples page's marker line becomes a section per example showing them, and a last section
with a pipeline whose calls may be in flight together (none of the examples has such calls), captured here.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import patchkit

MARKER = "<!-- the example graphs, made by docs/hooks/example_graphs.py -->"
ROOT = Path(__file__).resolve().parents[2]
IMAGES = "img/examples"
IN_FLIGHT = f"{IMAGES}/in-flight-together.svg"


@dataclass(frozen=True)
class ExampleGraph:
    """One pipeline of one example: where its picture goes in the site, and what the page says of it."""

    example: str  # the file's stem: "crag"
    name: str  # the module-level name of the pipeline: "pipeline"
    summary: str  # the first paragraph of the module's docstring
    calls: int
    svg: str

    @property
    def src_uri(self) -> str:
        stem = self.example if self.name == "pipeline" else f"{self.example}-{self.name}"
        return f"{IMAGES}/{stem}.svg"


def _load(path: Path) -> Any:
    """The example's module, run under a private name (not `__main__`), as `patchkit serve FILE.py` runs it."""
    name = f"_patchkit_docs_example_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # classes defined in it must be importable by their module's name
    spec.loader.exec_module(module)
    return module


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.strip().split("\n\n")[0].split())  # its first paragraph, on one line


@functools.cache
def example_graphs(root: Path = ROOT) -> tuple[ExampleGraph, ...]:
    """Every pipeline of every examples/*.py, `pipeline` (what `patchkit serve` serves) first in each file."""
    found = []
    for path in sorted((root / "examples").glob("*.py")):
        if path.name.startswith("_"):
            continue
        module = _load(path)
        pipelines = {name: value for name, value in vars(module).items() if isinstance(value, patchkit.Pipeline)}
        assert pipelines, f"{path.relative_to(root)} holds no pipeline at module level"
        for name in sorted(pipelines, key=lambda n: (n != "pipeline", n)):
            graph = pipelines[name].graph
            found.append(ExampleGraph(path.stem, name, _summary(path), len(graph.nodes), graph.to_svg()))
    return tuple(found)


def in_flight_together() -> patchkit.Pipeline:
    """Two searches of one question, then three rewrites of it and a search for each: calls a request may have
    in flight together, deployed with parallel calls."""
    from patchkit.components import BM25Search, FaissRetriever, LlamaCppGenerator, merge_hits

    dense, keywords = FaissRetriever("pydoc", topk=3), BM25Search("pydoc", topk=3)
    llm = LlamaCppGenerator(max_tokens=64)
    question = "How do I catch an exception?"
    with patchkit.capture(run=False) as pipeline:  # nothing loads or runs
        found = dense.retrieve(question)
        matched = keywords.search(question)
        docs = merge_hits(found, matched)
        styles = ("shorter", "broader", "more technical")
        rewrites = [llm.generate(f"Rewrite as a {style} question: {question}") for style in styles]
        more = [dense.retrieve(rewrite) for rewrite in rewrites]
        return llm.generate(question, docs + [doc for hits in more for doc in hits])  # the pipeline's output
    return pipeline  # run=False skipped the body, so this function goes on to here


def _in_flight_section() -> list[str]:
    source = inspect.getsource(in_flight_together).rstrip()
    return [
        "## Calls in flight together",
        "",
        "In none of the examples above may a request have two calls in flight at once: each call needs the "
        "result of the one before it. In this pipeline it may ([Parallel calls](parallel-calls.md)): the two "
        "searches of the question overlap (one fill), and each comprehension's calls reach their component "
        "together (a stacked box).",
        "",
        "```python",
        source,
        "```",
        "",
        f"![A pipeline whose calls may be in flight together]({IN_FLIGHT})",
        "",
    ]


def markdown(graphs: tuple[ExampleGraph, ...]) -> str:
    """The Examples page's sections: per example, its summary, how to run it, and its pictures."""
    parts: list[str] = []
    for example in dict.fromkeys(graph.example for graph in graphs):
        own = [graph for graph in graphs if graph.example == example]
        parts += [f"## {example}.py", "", own[0].summary, "", f"`patchkit serve examples/{example}.py` serves it.", ""]
        for graph in own:
            if len(own) > 1:
                parts += [f"`{graph.name}`:", ""]
            parts += [f"![The pipeline graph of examples/{example}.py, {graph.name}]({graph.src_uri})", ""]
            if graph.calls == 0:
                parts += [
                    "No component call is made in the captured block itself: they are made inside the "
                    "helper functions it calls, so the graph shows only its input and its output.",
                    "",
                ]
    return "\n".join(parts + _in_flight_section())


def on_pre_build(config: Any) -> None:
    """Called by MkDocs before each build: `mkdocs serve` rebuilds with what the files hold now."""
    example_graphs.cache_clear()


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    """Called by `mkdocs serve`: an edit of examples/ rebuilds the site too."""
    server.watch(str(ROOT / "examples"))
    return server


def on_files(files: Any, config: Any) -> Any:
    """Called by MkDocs once the documentation files are collected: each graph becomes a file of the site."""
    from mkdocs.structure.files import File

    for graph in example_graphs():
        files.append(File.generated(config, graph.src_uri, content=graph.svg))
    files.append(File.generated(config, IN_FLIGHT, content=in_flight_together().graph.to_svg()))
    return files


def on_page_markdown(markdown_text: str, page: Any, config: Any, files: Any) -> str:
    """Called by MkDocs for every page before it is rendered: the marker line becomes the examples' sections."""
    if MARKER not in markdown_text:
        return markdown_text
    return markdown_text.replace(MARKER, markdown(example_graphs()))
