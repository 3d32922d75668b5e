"""What the files a component reads digest to: part of its identity (`patchkit.program.identity`).

A component names the files and directories its `setup()` reads (`Component.version_files`: a retriever's
corpus directory, a generator's model file); their digest changes when any of them does. A file of up to
`HASHED_BYTES` is read and hashed; a larger one (a model of hundreds of megabytes) counts by its size and
modification time, which any write changes, so it is never read whole on an update. A directory counts by
every file under it (hidden ones and `__pycache__` left out), by relative path: a file added, removed or
renamed changes the digest. A path that is not there counts as missing (the component's own `setup()` says
why it cannot load it).

Hashes of files are kept per process by (path, size, modification time): a second update reads nothing
that did not change.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

__all__ = ["HASHED_BYTES", "files_digest"]

HASHED_BYTES = 4 << 20  # files up to this size are hashed whole; larger ones count by size and modification time
_SKIPPED = ("__pycache__",)


def files_digest(paths: Iterable[str | os.PathLike[str]]) -> str:
    """One digest of everything under `paths` (files, or directories walked): see the module's docstring."""
    whole = hashlib.sha256()
    for path in sorted({os.path.abspath(os.fspath(p)) for p in paths}):
        whole.update(f"{path}\0".encode())
        for relative, stamp in _entries(Path(path)):
            whole.update(f"{relative}\0{stamp}\0".encode())
    return whole.hexdigest()


def _entries(root: Path) -> Iterable[tuple[str, str]]:
    """(relative path, what the file digests to) for `root` (a file: itself, as "") or each file under it."""
    if root.is_file():
        yield "", _file(root)
        return
    if not root.is_dir():
        yield "", "missing"
        return
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if not d.startswith(".") and d not in _SKIPPED)
        for name in sorted(files):
            if not name.startswith("."):
                path = Path(directory, name)
                yield path.relative_to(root).as_posix(), _file(path)


def _file(path: Path) -> str:
    try:
        found = path.stat()
    except OSError:
        return "unreadable"
    if found.st_size > HASHED_BYTES:
        return f"size {found.st_size} modified {found.st_mtime_ns}"
    return _content(str(path), found.st_size, found.st_mtime_ns)


@lru_cache(maxsize=65536)
def _content(path: str, size: int, modified_ns: int) -> str:
    """A small file's content hash, kept while its size and modification time stay those it was read at."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return f"unreadable {size} {modified_ns}"
