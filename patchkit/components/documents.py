"""Documents to retrieve from.

Loaders for strings, a directory of text files, and the default corpus, the Python documentation every Python ships (pydoc topics
and module docstrings), chunked with overlap. Each chunk carries an id, a title and the text; `fingerprint()` names the content
for the on-disk index cache.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from patchkit import envs

__all__ = [
    "Document", "Hit", "chunk", "fingerprint", "from_directory", "from_texts", "load_corpus", "merge_hits", "pydoc_corpus",
    "sources",
]

CHUNK_WORDS = 160  # about 220 tokens: inside MiniLM's 256-token window
OVERLAP_WORDS = 32
TEXT_SUFFIXES = (".txt", ".md", ".rst")
MIN_MODULE_WORDS = 8  # fewer says nothing a question could match
SHORT_DOCSTRING_WORDS = 40  # a module docstring shorter than this gets its definitions' summaries

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Document:
    """A chunk of text to retrieve.

    Attributes:
        id: unique in its corpus: its source and the chunk's number (`text0#2`, `module:json#0`).
        title: what the chunk came from (a file's path, a module's name, a text's first words).
        text: the chunk's words.
    """

    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Hit:
    """One search result.

    A chunk's id, title and text, and its score (cosine similarity for the vector retrievers, BM25 for `BM25Search`).
    """

    id: str
    title: str
    text: str
    score: float


def merge_hits(*lists: Sequence[Hit]) -> list[Hit]:
    """The hits of every list, each id once (its first occurrence), in the order first seen.

    Args:
        *lists: lists of hits, such as two retrievers' results.

    Returns:
        The merged list.
    """
    merged: dict[str, Hit] = {}
    for hits in lists:
        for hit in hits:
            merged.setdefault(hit.id, hit)
    return list(merged.values())


def sources(docs: Iterable[object]) -> list[str]:
    """The titles of retrieved hits (or the opening words of plain strings), each once, in order.

    Args:
        docs: hits, documents or strings.

    Returns:
        Their titles.
    """
    return list(dict.fromkeys(" ".join(d.split()[:6]) if isinstance(d, str) else str(getattr(d, "title", d)) for d in docs))


def chunk(title: str, text: str, *, source: str, words: int = CHUNK_WORDS, overlap: int = OVERLAP_WORDS) -> list[Document]:
    """Split `text` into chunks of `words` words, each starting `words - overlap` after the last."""
    if not 0 <= overlap < words:
        raise ValueError(f"overlap ({overlap}) must be >= 0 and < words ({words})")
    tokens = text.split()
    step = words - overlap
    starts = range(0, max(1, len(tokens) - overlap), step)
    return [Document(f"{source}#{i}", title, " ".join(tokens[start : start + words])) for i, start in enumerate(starts) if tokens]


def from_texts(texts: Sequence[str], *, words: int = CHUNK_WORDS, overlap: int = OVERLAP_WORDS) -> list[Document]:
    """One document per string (chunked when long); titled by their first words.

    Args:
        texts: the strings.
        words: the words of a chunk (about 220 tokens by default: inside MiniLM's window).
        overlap: the words each chunk repeats of the one before.

    Returns:
        The documents.

    Raises:
        TypeError: an item that is not a string.
    """
    docs: list[Document] = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"corpus text {i} is a {type(text).__name__}; pass strings")
        docs += chunk(" ".join(text.split()[:8]), text, source=f"text{i}", words=words, overlap=overlap)
    return docs


def from_directory(path: str | Path, *, words: int = CHUNK_WORDS, overlap: int = OVERLAP_WORDS) -> list[Document]:
    """Every .txt, .md and .rst file under `path`, chunked, titled by its path relative to it.

    Args:
        path: the directory.
        words: the words of a chunk (about 220 tokens by default: inside MiniLM's window).
        overlap: the words each chunk repeats of the one before.

    Returns:
        The documents.

    Raises:
        FileNotFoundError: `path` is not a directory.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {root} does not exist; pass a directory of .txt/.md files")
    docs: list[Document] = []
    for file in sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()):
        name = str(file.relative_to(root))
        docs += chunk(name, file.read_text(encoding="utf-8", errors="replace"), source=name, words=words, overlap=overlap)
    return docs


def pydoc_corpus(*, topics: bool = True, words: int = CHUNK_WORDS, overlap: int = OVERLAP_WORDS) -> list[Document]:
    """The Python documentation this interpreter ships.

    Every pydoc topic, then every public standard-library module's docstring, read from its source without
    importing it. Kept in the cache directory (`corpus/`), keyed by this interpreter and this module's code:
    reading the whole standard library's sources takes seconds, which every process indexing the corpus
    would pay again (a plan's calibration twice, then each retriever's worker).

    Args:
        topics: include the pydoc topics (False: the module docstrings alone).
        words: the words of a chunk (about 220 tokens by default: inside MiniLM's window).
        overlap: the words each chunk repeats of the one before.

    Returns:
        The documents.
    """
    key = hashlib.sha256(json.dumps([sys.version, sys.base_prefix, topics, words, overlap]).encode())
    key.update(Path(__file__).read_bytes())
    path = envs.cache_dir() / "corpus" / f"pydoc-{key.hexdigest()[:16]}.json"
    try:
        return [Document(*row) for row in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        pass  # not kept yet, or damaged: read again
    docs = _read_pydoc(topics, words, overlap)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = path.with_suffix(f".{os.getpid()}.tmp")
        kept.write_text(json.dumps([[d.id, d.title, d.text] for d in docs]))
        kept.replace(path)  # processes building it at once: the last rename wins, whole
    except OSError as exc:
        logger.info("the pydoc corpus is not kept in %s: %s", path.parent, exc)
    return docs


def _read_pydoc(topics: bool, words: int, overlap: int) -> list[Document]:
    from pydoc_data.topics import topics as texts

    docs: list[Document] = []
    for name in sorted(texts) if topics else []:
        docs += chunk(name, texts[name], source=f"topic:{name}", words=words, overlap=overlap)
    for module, text in _module_docstrings(sorted(sys.stdlib_module_names)):
        docs += chunk(module, text, source=f"module:{module}", words=words, overlap=overlap)
    return docs


def _module_docstrings(names: Iterable[str]) -> Iterable[tuple[str, str]]:
    for name in names:
        if name.startswith("_"):
            continue
        text = _module_text(name)
        if text and len(text.split()) >= MIN_MODULE_WORDS:
            yield name, text


def _module_text(name: str) -> str | None:
    """What `pydoc NAME` would open with.

    The module's docstring, and where that is short (csv's is five words, dataclasses has none) the first line of each public
    class's and function's docstring.

    Python modules are read from source, never imported (importing some has effects: antigravity
    opens a browser); frozen ones (os, posixpath) from the source file they were frozen from; a
    wrapper with neither docstring nor definitions of its own (decimal) from its pure-Python twin
    `_pyNAME`. Only built-in and extension modules (itertools, time, zlib), which have no source,
    are imported to read their `__doc__`.
    """
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    state = spec.loader_state
    origin = getattr(state, "filename", None) if spec.origin == "frozen" else spec.origin
    if origin is not None and origin.endswith(".py"):
        text = _source_text(Path(origin))
        twin = Path(origin).with_name(f"_py{name}.py")
        return text or (_source_text(twin) if twin.is_file() else None)
    if spec.origin == "built-in" or (origin is not None and origin.endswith(".so")):
        try:
            module = importlib.import_module(name)
        except Exception:  # an extension for another platform, or one missing its system library
            return None
        members = [(n, getattr(module, n, None)) for n in sorted(vars(module)) if not n.startswith("_")]
        summaries = [(n, _first_line(getattr(m, "__doc__", None))) for n, m in members if callable(m)]
        return _with_summaries(module.__doc__ if isinstance(module.__doc__, str) else "", summaries)
    return None


def _source_text(path: Path) -> str | None:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    doc = ast.get_docstring(tree) or _assigned_doc(tree)
    summaries = [
        (node.name, _first_line(ast.get_docstring(node)))
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_")
    ]
    return _with_summaries(doc, summaries) or None


def _assigned_doc(tree: ast.Module) -> str:
    """`__doc__ = \"\"\"...\"\"\"` at module level (hashlib sets its docstring so)."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__doc__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return inspect.cleandoc(node.value.value)
    return ""


def _first_line(doc: str | None) -> str:
    return doc.strip().split("\n\n")[0].replace("\n", " ").strip() if doc else ""


def _with_summaries(doc: str, summaries: Sequence[tuple[str, str]]) -> str:
    if len(doc.split()) >= SHORT_DOCSTRING_WORDS:
        return doc
    lines = [f"{name}: {line}" for name, line in summaries if line]
    return "\n".join([doc, *lines]).strip()


def load_corpus(corpus: str | Sequence[str]) -> list[Document]:
    """`"pydoc"`, a directory path, or a list of strings; an empty corpus is an error naming the fix."""
    if isinstance(corpus, str):
        docs = pydoc_corpus() if corpus == "pydoc" else from_directory(corpus)
        where = "the pydoc corpus" if corpus == "pydoc" else f"directory {corpus}"
    else:
        docs, where = from_texts(list(corpus)), "the list of texts"
    if not docs:
        raise ValueError(f"{where} holds no text to index; give a directory of .txt/.md files or a non-empty list")
    return docs


def fingerprint(docs: Sequence[Document]) -> str:
    """A short digest of the documents' ids, titles and texts: an index built from them is named by it."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(f"{doc.id}\0{doc.title}\0{doc.text}\0".encode())
    return digest.hexdigest()[:16]
