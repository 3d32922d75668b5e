"""`patchkit serve --reload`: each served pipeline's file watched, and served again when it changes.

A thread polls the files' modification times and sizes (no dependency; an editor's save is seen within
about two polls). A file that changed and then held still for one poll is loaded again (the script run
again, or the module imported again), captured, and handed to the server's `update` on the server's event
loop: the components whose identity did not change (`patchkit.program.identity`: their class, its attributes
and defaults, the module globals and helpers their code reads, their constructor arguments) keep their
workers, new ones start and finish `setup()` before the new version takes requests. The log names what
changed, as `reloading app.py: gen changed: Gen.PROMPT, helper fmt`; a save that changes none of it (a
comment, a blank line) serves on as it was. A reload that fails (the file does not run or
import, it captures nothing, a component's `setup()` raises or its worker dies at start) is one ERROR line
naming the reason, and the version before keeps serving; the next change of the file is tried again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import traceback
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from patchkit.program.identity import Identity, identity

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline
    from patchkit.server.process import FrontendServer

__all__ = ["POLL_S", "Reloader", "Watched", "changes", "identities", "reason", "stamp"]

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the files are looked at
Stamp = tuple[int, int]  # a file's modification time (ns) and size: either changes on a write
T = TypeVar("T")
Identities = tuple[Identity, dict[str, Identity]]  # a pipeline's own, and its components' by name


def stamp(path: Path) -> Stamp | None:
    """What tells a change of `path`: its modification time and size; None while it is not there (an editor
    replacing it)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_mtime_ns, found.st_size


@dataclass
class Watched:
    """A served pipeline's file: `name`, the pipeline as served; `path`, the file watched; `load`, what makes the
    pipeline from it again (raises why not); `shown`, how the log names it; `stamp`, the file's as last loaded."""

    name: str
    path: Path
    load: Callable[[], Pipeline]
    shown: str
    stamp: Stamp | None
    seen: Stamp | None = None  # as the last poll saw it: a change is loaded once it holds still for a poll

    def __post_init__(self) -> None:
        self.seen = self.stamp


class _Stopping(Exception):
    """The server stopped while a reload waited for it."""


class Reloader:
    """Watches `watched` from a thread of its own and serves each file's new pipeline as it changes.

    Made by `patchkit serve --reload`; `start` is called on the server's event loop once it serves (by
    `serve_blocking`'s `on_ready`), `stop` once `serve_blocking` has returned. Reloads run one at a time, in
    the watching thread; only `FrontendServer.update` runs on the server's loop."""

    def __init__(self, watched: Sequence[Watched], *, poll_s: float = POLL_S) -> None:
        self.watched = list(watched)
        self.poll_s = poll_s
        self._server: FrontendServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._loaded: dict[str, Identities] = {}  # by pipeline: the identities of the version last loaded
        self._thread = threading.Thread(target=self._watch, name="patchkit-reload", daemon=True)

    def start(self, server: FrontendServer) -> None:
        """Start watching; called on `server`'s event loop, which its updates then run on."""
        self._server, self._loop = server, asyncio.get_running_loop()
        for watched in self.watched:  # now, while the modules' globals are still those of the serving version
            version = server.frontend.versions.get(watched.name)
            if version is not None:
                self._loaded[watched.name] = identities(version.pipeline)
        self._thread.start()
        logger.info("--reload: watching %s", ", ".join(str(w.path) for w in self.watched))

    def stop(self) -> None:
        """Stop watching and wait for the thread to end (a load in progress finishes first; its update is not made)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Look at every file once; reload those that changed and then held still since the last look."""
        for watched in self.watched:
            now = stamp(watched.path)
            if now is None or now == watched.stamp or now != watched.seen:
                watched.seen = now
                continue
            watched.stamp = now
            if self._stopped.is_set():
                return
            self.reload(watched)

    def reload(self, watched: Watched) -> None:
        """Load `watched` again and serve it as its pipeline's next version; log the version now serving, or why
        not (the one before serving on)."""
        try:
            pipeline = watched.load()
            loaded = identities(pipeline)
            digest = pipeline.fingerprint()
            tag, changed = self._on_loop(self._update(watched.name, pipeline, digest))
        except _Stopping:
            return
        except (Exception, SystemExit) as exc:  # a script's sys.exit() too: it must not end the watching
            if self._stopped.is_set():
                return
            logger.error("reloading %s failed, %s version %s serves on: %s", watched.shown, watched.name,
                         self._serving(watched.name), reason(exc, watched.path))
            logger.debug("the failed reload of %s", watched.shown, exc_info=exc)
            return
        if tag is None:
            return  # the server is stopping
        before = self._loaded.get(watched.name)
        self._loaded[watched.name] = loaded
        if changed:
            if before is not None:
                logger.info("reloading %s: %s", watched.shown, "; ".join(changes(before, loaded)) or "nothing changed")
            logger.info("reloaded %s: %s version %s serves", watched.shown, watched.name, tag)
        else:
            logger.info("reloaded %s: its pipeline did not change, %s version %s serves on", watched.shown, watched.name, tag)

    async def _update(self, name: str, pipeline: Pipeline, digest: str) -> tuple[str | None, bool]:
        """On the server's loop: `pipeline` as `name`'s next version, unless it is the one serving; its tag and
        whether it is new (None where the server is stopping)."""
        assert self._server is not None
        frontend = self._server.frontend
        if frontend.closing:
            return None, False
        current = frontend.versions.get(name)
        if current is not None and current.digest == digest:
            return current.tag, False
        described = (await self._server.update({name: pipeline}))[name]
        return f"{described['version']}-{described['digest']}", True

    def _on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the server's loop and wait for it; raises _Stopping if the server stops first."""
        assert self._loop is not None
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except RuntimeError:  # the loop has closed
            coroutine.close()
            raise _Stopping from None
        while True:
            try:
                return future.result(timeout=self.poll_s)
            except concurrent.futures.TimeoutError:
                if self._stopped.is_set():
                    future.cancel()
                    raise _Stopping from None
            except concurrent.futures.CancelledError:
                raise _Stopping from None

    def _serving(self, name: str) -> str:
        """The tag of the version of `name` serving now (read from this thread: the reloads are the only updates)."""
        version = self._server.frontend.versions.get(name) if self._server is not None else None
        return version.tag if version is not None else "none"


def identities(pipeline: Pipeline) -> Identities:
    """A pipeline's own identity (its code, the globals it reads, its inputs) and each component's, by name."""
    own = pipeline.identity()
    parts = {label: part for label, part in own.parts.items() if not label.startswith("component ")}
    return Identity(parts), {name: identity(c) for name, c in pipeline.components.items()}


def changes(before: Identities, after: Identities) -> list[str]:
    """What differs from `before` to `after`, one entry per pipeline or component, naming the parts changed:
    `gen changed: Gen.PROMPT, module constant TEMPLATE`, `the pipeline changed: pipeline code`, `rank is new`."""
    found = []
    if own := after[0].changes(before[0]):
        found.append(f"the pipeline changed: {', '.join(own)}")
    for name, component in after[1].items():
        old = before[1].get(name)
        if old is None:
            found.append(f"{name} is new")
        elif parts := component.changes(old):
            found.append(f"{name} changed: {', '.join(parts)}")
    found += [f"{name} is gone" for name in before[1] if name not in after[1]]
    return found


def reason(exc: BaseException, path: Path) -> str:
    """Why a reload of `path` failed, on one line: the error and where in the file it was raised, as
    `app.py, line 3: SyntaxError: invalid syntax`."""
    shown = _relative(path)
    if isinstance(exc, SyntaxError):
        where = _relative(Path(exc.filename)) if exc.filename else shown
        return f"{where}, line {exc.lineno}: {type(exc).__name__}: {exc.msg}"
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _same_file(f.filename, path)]
    return f"{shown}, line {frames[-1].lineno}: {text}" if frames else text


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _same_file(filename: str, path: Path) -> bool:
    try:
        return Path(filename).resolve() == path.resolve()
    except OSError:
        return False
