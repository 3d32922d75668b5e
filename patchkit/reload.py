"""`patchkit serve --reload` and `patchkit mcp --reload`: each served pipeline's file, and the user's modules the
pipelines import, watched; a pipeline served again when what it reads changes.

A thread polls the files' modification times and sizes (no dependency; an editor's save is seen within
about two polls). The files are each target's own (its script, or its module's file) and those of the
user's own modules its load imported (`import prompts` beside the script: every module but the standard
library's, patchkit's and an installed distribution's, `patchkit.program.identity`), as uvicorn's `--reload`
watches the project. A file that changed and then held still for one poll is loaded again: a target's own
file, that target; one of the user's modules, every target, those modules imported afresh (a module Python
holds already would serve its old code). Each is captured again and handed to the server's `update` on the
server's event loop, its version computed first here (`Pipeline.stamp`, on this thread): the components
whose identity did not change (their class, its attributes and defaults, the module globals and helpers
their code reads, their constructor arguments, the files they read) keep their workers, new ones start and
finish `setup()` before the new version takes requests. The log names the file and what changed, as
`reloading app.py (prompts.py changed): gen changed: Gen.PROMPT, helper prompts.fmt`; a save that changes none
of it (a comment, a blank line) serves on as it was. A reload that fails (the file does not run or import,
it captures nothing, a component's `setup()` raises or its worker dies at start) is one ERROR line naming
the reason, and the version before keeps serving; the next change of the file is tried again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from patchkit.program.identity import PipelineVersion
from patchkit.program.origin import users_module

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline
    from patchkit.server.mcp.stdio import StdioServer
    from patchkit.server.process import FrontendServer

    Served = FrontendServer | StdioServer  # what a reloader updates: `patchkit serve`'s server, or `patchkit mcp`'s

__all__ = ["POLL_S", "Reloader", "Watched", "imported_modules", "reason", "stamp"]

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the files are looked at
Stamp = tuple[int, int]  # a file's modification time (ns) and size: either changes on a write
T = TypeVar("T")


def stamp(path: Path) -> Stamp | None:
    """What tells a change of `path`: its modification time and size; None while it is not there (an editor
    replacing it)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_mtime_ns, found.st_size


def imported_modules(before: Collection[str]) -> dict[str, Path]:
    """The user's own modules (`patchkit.program.identity.users_module`) imported since `before` (the names
    `sys.modules` held then) that have a file: what a reload watches and imports afresh."""
    found = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name not in before and file and users_module(name):
            found[name] = Path(file).resolve()
    return found


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

    def settled(self) -> bool:
        """Whether the file changed and then held still for a poll (`_settled`); called once per poll."""
        return _settled(self)


@dataclass
class _ModuleFile:
    """The file of one of the user's modules a target's load imported: `shown`, how the log names it."""

    path: Path
    shown: str
    stamp: Stamp | None
    seen: Stamp | None = None

    def __post_init__(self) -> None:
        self.seen = self.stamp

    def settled(self) -> bool:
        return _settled(self)


def _settled(file: Watched | _ModuleFile) -> bool:
    """Whether `file` changed since it was last loaded and held still since the last poll (then it is taken as
    loaded)."""
    now = stamp(file.path)
    if now is None or now == file.stamp or now != file.seen:
        file.seen = now
        return False
    file.stamp = now
    return True


class _Stopping(Exception):
    """The server stopped while a reload waited for it."""


class Reloader:
    """Watches `watched` and `modules` (the user's modules their loads imported, by name) from a thread of its
    own, and serves each file's new pipeline as it changes.

    Made by `patchkit serve --reload`; `start` is called on the server's event loop once it serves (by
    `serve_blocking`'s `on_ready`), `stop` once `serve_blocking` has returned. Reloads run one at a time, in
    the watching thread; only the server's `update` runs on its loop."""

    def __init__(self, watched: Sequence[Watched], modules: dict[str, Path] | None = None, *, poll_s: float = POLL_S) -> None:
        self.watched = list(watched)
        self.poll_s = poll_s
        self._modules: dict[str, _ModuleFile] = {}
        self._watch_modules(modules or {})
        self._server: Served | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._loaded: dict[str, PipelineVersion] = {}  # by pipeline: the version last loaded
        self._thread = threading.Thread(target=self._watch, name="patchkit-reload", daemon=True)

    def start(self, server: Served) -> None:
        """Start watching; called on `server`'s event loop, which its updates then run on."""
        self._server, self._loop = server, asyncio.get_running_loop()
        for watched in self.watched:
            version = server.frontend.versions.get(watched.name)
            if version is not None and version.pipeline.stamped is not None:
                self._loaded[watched.name] = version.pipeline.stamped
        self._thread.start()
        files = [str(w.path) for w in self.watched] + [str(m.path) for m in self._modules.values()]
        logger.info("--reload: watching %s", ", ".join(files))

    def stop(self) -> None:
        """Stop watching and wait for the thread to end (a load in progress finishes first; its update is not made)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            self.poll()

    def _watch_modules(self, modules: dict[str, Path]) -> None:
        for name, path in modules.items():
            if name not in self._modules or self._modules[name].path != path:
                self._modules[name] = _ModuleFile(path, _relative(path), stamp(path))

    def poll(self) -> None:
        """Look at every file once; reload what changed and then held still since the last look: every target
        where one of the user's modules did (those modules imported afresh), else the targets whose own file did."""
        modules = [m for m in self._modules.values() if m.settled()]
        targets = [w for w in self.watched if w.settled()]
        if modules:
            self._forget_modules()
            targets, why = self.watched, f" ({', '.join(m.shown for m in modules)} changed)"
        else:
            why = ""
        if not targets:
            return  # nothing to load: sys.modules is not read on an idle poll
        before = set(sys.modules)
        for watched in targets:
            if self._stopped.is_set():
                return
            self.reload(watched, why)
        self._watch_modules(imported_modules(before))

    def _forget_modules(self) -> None:
        """Drop the user's modules from `sys.modules`, so that the loads that follow import them afresh."""
        for name in self._modules:
            sys.modules.pop(name, None)

    def reload(self, watched: Watched, why: str = "") -> None:
        """Load `watched` again and serve it as its pipeline's next version; log the version now serving, or why
        not (the one before serving on). `why`: the files that changed, for the log, where not its own."""
        shown = f"{watched.shown}{why}"
        try:
            pipeline = watched.load()
            loaded = pipeline.stamp()  # here, on this thread: the server's loop only compares it
            tag, changed = self._on_loop(self._update(watched.name, pipeline, loaded.digest))
        except _Stopping:
            return
        except (Exception, SystemExit) as exc:  # a script's sys.exit() too: it must not end the watching
            if self._stopped.is_set():
                return
            logger.error("reloading %s failed, %s version %s serves on: %s", shown, watched.name,
                         self._serving(watched.name), reason(exc, watched.path))
            logger.debug("the failed reload of %s", shown, exc_info=exc)
            return
        if tag is None:
            return  # the server is stopping
        before = self._loaded.get(watched.name)
        self._loaded[watched.name] = loaded
        if changed:
            if before is not None:
                logger.info("reloading %s: %s", shown, "; ".join(loaded.changes(before)) or "nothing changed")
            logger.info("reloaded %s: %s version %s serves", shown, watched.name, tag)
        else:
            logger.info("reloaded %s: its pipeline did not change, %s version %s serves on", shown, watched.name, tag)

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
