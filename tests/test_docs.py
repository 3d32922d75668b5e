"""Every example in README.md and docs/ runs as written, in page order, and shows what it really prints.

A page's fenced blocks are its examples, one test each, run in the order the page shows them:

- ```` ```python ````: run (with pytest-examples) in one namespace per page, so a block goes on from the
  blocks above it; each `#>` comment under a `print(...)` is checked against what that call printed.
- ```` ```console ````: each `$ ` line (with its `\\` continuations) runs with bash in the page's own
  working directory, the virtual environment's `bin` first on PATH; the lines under it are its output,
  compared with doctest's rules (`...` matches anything, runs of whitespace compare equal): its stdout,
  or its stdout and stderr where it fails (the page shows an error; one shown without output must
  succeed). Log lines on stderr beside a command's output are not part of what a page shows.
  `patchkit serve ...` keeps running, as in a terminal: it starts in the background, the output
  shown is its first line (the address it serves at), and it gets Ctrl-C (SIGINT) when the page ends.
- ```` ```bash ````: commands run with bash as one script, which must succeed.
- a block with a `title="app.py"` (any language): a file the page's commands use, written to the
  page's working directory before the block after it runs.

An HTML comment `<!-- skip: why -->` right above a block skips it, the reason in pytest's summary. A block
runs the unrun blocks above it first, so one test selected on its own (`-k`) still runs as written; a
failure fails the blocks after it on its page, naming the first. Blocks that start processes (a
deploy, a plan, a shell command) or load models, and every block after them on their page, are `slow`.
"""

from __future__ import annotations

import doctest
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytest_examples", reason="runs the pages' examples with pytest-examples (the dev extra)")

import pytest_examples.run_code  # noqa: E402
from pytest_examples import CodeExample, EvalExample  # noqa: E402

import patchkit  # noqa: E402
from patchkit.config import file as config_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)(?P<info>[^\n`]*)$")
SKIP = re.compile(r"^<!--\s*skip:\s*(?P<reason>.+?)\s*-->$")
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
PYTHON = ("python", "py")
SHELL = ("console", "bash", "sh")
# What makes a block slow: starting processes (a deployment, a plan, a served script) or loading models.
STARTS_PROCESSES = re.compile(r"\bdeploy\(|\bplan\(|from patchkit\.components import")
SERVER_READY_S = 120.0  # a served script's start, its workers' included, on 2 busy cores
COMMAND_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
LINE_LENGTH = 130  # the project's (ruff's): a printed value longer than this is shown as black formats it
OUTPUT = doctest.OutputChecker()
OUTPUT_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it is, what it holds, and why it is skipped, if it is."""

    page: Path
    line: int  # the opening fence's, from 1
    lang: str
    title: str | None
    source: str
    skip: str | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        """Whether it is an example: Python, a shell session or script, or a file the page's commands use."""
        return self.title is not None or self.lang in PYTHON + SHELL

    @property
    def starts_processes(self) -> bool:
        if self.lang in SHELL:
            return True
        return self.lang in PYTHON and self.title is None and bool(STARTS_PROCESSES.search(self.source))


def blocks_of(page: Path) -> list[Block]:
    """Every fenced block of a page at the margin, in order, with the skip comment on the line above it."""
    lines = page.read_text().splitlines()
    found, index, previous = [], 0, ""
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            if lines[index].strip():
                previous = lines[index].strip()
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].rstrip() == opening["fence"]), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{index + 1}: a fence that never closes"
        title = TITLE.search(opening["info"])
        skip = SKIP.match(previous)
        found.append(Block(
            page, index + 1, opening["lang"].lower(), title["title"] if title else None,
            "\n".join(lines[index + 1:end]) + "\n", skip["reason"] if skip else None,
        ))
        index, previous = end + 1, ""
    return found


EXAMPLES = {page: [block for block in blocks_of(page) if block.runs] for page in PAGES}


def _params() -> Iterator[Any]:
    for blocks in EXAMPLES.values():
        slow = False
        for block in blocks:
            slow = slow or (block.skip is None and block.starts_processes)
            yield pytest.param(block, id=block.name, marks=[pytest.mark.slow] if slow else [])


# -- running a page --------------------------------------------------------------------------------------------
@dataclass
class Server:
    """A `patchkit serve` started by a console block: its process and what it has printed on each stream."""

    process: subprocess.Popen[str]
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    exited: threading.Event = field(default_factory=threading.Event)
    readers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        """Read both streams on threads of their own, so that no pipe fills; `ready` once stdout has a line."""
        for stream, into in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr)):
            self.readers.append(threading.Thread(target=self._read, args=(stream, into), daemon=True))
            self.readers[-1].start()

    def _read(self, stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)
            if into is self.stdout:
                self.ready.set()
        if into is self.stdout:
            self.exited.set()  # its stdout closed: the process is ending
            self.ready.set()

    def printed(self) -> str:
        """Its first lines on stdout; everything it printed, stderr included, if it has exited."""
        if not self.exited.is_set():
            return "".join(self.stdout)
        self.process.wait(timeout=STOP_TIMEOUT_S)
        for reader in self.readers:
            reader.join()
        return "".join(self.stdout + self.stderr)

    def stop(self) -> None:
        """Ctrl-C, as a terminal sends it; killed if it does not stop in time."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        for reader in self.readers:
            reader.join()
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@dataclass
class PageRun:
    """A page's examples run so far: one namespace, one working directory, the servers its commands started."""

    blocks: list[Block]
    directory: Path
    namespace: dict[str, Any] = field(default_factory=dict)
    done: int = 0
    failed: str | None = None
    servers: list[Server] = field(default_factory=list)

    def run_through(self, block: Block, evaluator: EvalExample) -> None:
        """Run the page's unrun blocks above `block`, then `block`; close the page after its last block."""
        target = self.blocks.index(block)
        try:
            while self.done <= target:
                current = self.blocks[self.done]
                self.done += 1
                if current.skip is not None:
                    continue
                if self.failed is not None:
                    pytest.fail(f"{self.failed} failed, and this example goes on from it", pytrace=False)
                try:
                    self._run(current, evaluator)
                except BaseException:
                    self.failed = current.name
                    raise
        finally:
            if self.done == len(self.blocks):
                self.close()

    def _run(self, block: Block, evaluator: EvalExample) -> None:
        if block.title is not None:
            (self.directory / block.title).write_text(block.source)
        elif block.lang in PYTHON:
            self._python(block, evaluator)
        elif block.lang == "console":
            for command, shown in console_commands(block.source):
                self._command(block, command, shown)
        else:
            result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.source], cwd=self.directory, env=shell_env(),
                                    capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
            assert result.returncode == 0, f"{block.name}: exit status {result.returncode}\n{result.stdout}{result.stderr}"

    def _python(self, block: Block, evaluator: EvalExample) -> None:
        # Blank lines in front: the file pytest-examples runs has the page's line numbers, so a traceback, a
        # CaptureError or a graph names the line the page shows.
        example = CodeExample.create("\n" * block.line + block.source, path=block.page, prefix=block.lang)
        main = sys.modules["__main__"]  # pytest-examples runs each block as __main__, as a script runs
        cwd = Path.cwd()
        os.chdir(self.directory)
        try:
            with pytest.MonkeyPatch.context() as patch:
                # pytest-examples rewrites a failing example's traceback into frames that Python 3.11 cannot
                # format (pytest stops with INTERNALERROR): keep the real one, whose lines are the page's.
                patch.setattr(pytest_examples.run_code, "create_example_traceback", lambda *args: None)
                self.namespace.update(evaluator.run_print_check(example, module_globals=self.namespace))
        finally:
            os.chdir(cwd)
            sys.modules["__main__"] = main

    def _command(self, block: Block, command: str, shown: str) -> None:
        if command.startswith("patchkit serve "):
            got = self._serve(command)
        else:
            result = subprocess.run(["bash", "-c", command], cwd=self.directory, env=shell_env(), capture_output=True,
                                    text=True, timeout=COMMAND_TIMEOUT_S)
            got = result.stdout if result.returncode == 0 else result.stdout + result.stderr
            assert result.returncode == 0 or shown.strip(), (
                f"{block.name}: `{command}` exited with status {result.returncode}:\n{got}")
        if not OUTPUT.check_output(shown, got, OUTPUT_FLAGS):
            pytest.fail(f"{block.name}: `{command}` printed\n{got}\nwhere the page shows\n{shown}", pytrace=False)

    def _serve(self, command: str) -> str:
        """Start a long-running `patchkit serve`: what it printed once it printed its first line to stdout (the
        address it serves at), or everything it printed if it exited first (a bad option)."""
        process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.directory, env=shell_env(), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        server = Server(process)
        self.servers.append(server)
        server.start()
        assert server.ready.wait(SERVER_READY_S), f"`{command}` printed nothing in {SERVER_READY_S:.0f} s"
        return server.printed()

    def close(self) -> None:
        """Stop what the page started: its servers (Ctrl-C) and any endpoint its Python left open."""
        for server in self.servers:
            server.stop()
        self.servers.clear()
        for value in self.namespace.values():
            if isinstance(value, patchkit.Endpoint):
                value.close()
        self.namespace.clear()


def console_commands(source: str) -> list[tuple[str, str]]:
    """A console block's `$ ` commands (continuation lines joined) and the output shown under each."""
    commands: list[tuple[str, list[str]]] = []
    lines = iter(source.splitlines())
    for line in lines:
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):
                command += "\n" + next(lines)  # bash reads the backslash and newline as one line
            commands.append((command, []))
        else:
            assert commands, f"console output before any `$ ` command: {line!r}"
            commands[-1][1].append(line)
    return [(command, "\n".join(shown) + "\n" if shown else "") for command, shown in commands]


def shell_env() -> dict[str, str]:
    """This environment, the virtual environment's `bin` (patchkit, python, pip) first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Path, PageRun]]:
    runs = {page: PageRun(blocks, tmp_path_factory.mktemp(page.stem)) for page, blocks in EXAMPLES.items()}
    yield runs
    for run in runs.values():
        run.close()


@pytest.mark.parametrize("block", list(_params()))
def test_example(block: Block, pages: dict[Path, PageRun], eval_example: EvalExample) -> None:
    eval_example.set_config(line_length=LINE_LENGTH)
    if block.skip is not None:
        pages[block.page].run_through(block, eval_example)  # the blocks above it, for those after it
        pytest.skip(f"{block.name}: {block.skip}")
    pages[block.page].run_through(block, eval_example)


# -- the pages themselves ---------------------------------------------------------------------------------------
def test_the_readme_is_short_and_holds_both_set_up_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert 'python -m venv .venv && .venv/bin/pip install -e ".[retrieval,llm]" && .venv/bin/patchkit demo' in readme
    assert 'python -m venv .venv && .venv/bin/pip install -e ".[dev]" && .venv/bin/python -m pytest' in readme


def test_the_readme_links_to_pages_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]*)", readme)
    assert len(links) >= 11
    for link in links:
        assert (ROOT / link).exists(), link


def test_every_fence_is_found() -> None:
    """A fence indented in a list or a quote would escape the runner: the pages keep every fence at the margin."""
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not re.match(r"\s+(```|~~~)", line), f"{page.relative_to(ROOT)}:{number}: an indented fence"


def test_the_option_table_lists_every_key() -> None:
    table = config_file.markdown_table()
    for key in config_file.ServeFile.model_fields:
        if key not in ("components", "pipelines"):
            assert f"| `{key}` |" in table, key
    for key in config_file.ComponentOptions.model_fields:
        assert f"`components.NAME.{key}`" in table, key
    for key in config_file.PipelineOptions.model_fields:
        assert f"`pipelines.NAME.{key}`" in table, key
    assert config_file.TABLE_MARKER in (ROOT / "docs" / "reference" / "config.md").read_text()
