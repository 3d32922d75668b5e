"""Child processes with a bootstrap, a ready report and a lifeline: the worker and the front-end.

The parent writes a length-prefixed bootstrap to the child's stdin and keeps stdin open. The child
answers with one JSON line on its original stdout (its own prints then go to stderr), and exits as
soon as stdin reaches end-of-file: when the parent closes it, or when the parent dies for any
reason, SIGKILL included. No child outlives its parent. A child that takes messages (the front-end:
updates) reads more length-prefixed frames on that pipe and answers each with one JSON line
(`Child.ask`, `ChildSide.answer_with`). Each message carries an id that its answer repeats, so an
answer that comes after its asker gave up is told apart from the next one's (and discarded, logged);
a message not answered in time is withdrawn, and its answer then says whether it was applied.

A worker starts in a session (so a process group) of its own, which whatever its component starts
joins: when its lifeline ends it stops the group's other processes before it exits, and the parent
stopping it stops the group again (which a worker killed with SIGKILL could not). So no process a
component's `setup()` started outlives its worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import itertools
import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar, cast

from patchkit.errors import PatchkitError, WorkerDiedError, error_from_json, error_to_json

__all__ = ["Child", "ChildSide", "Message", "spawn", "stop_group"]

logger = logging.getLogger(__name__)

_LENGTH = 8
_ASK, _WITHDRAW = b"a", b"w"  # what a message frame is: after its id, before its body
WITHDRAW_TIMEOUT_S = 30.0  # how long a message not answered in time waits for its withdrawal's answer
GROUP_GRACE_S = 2.0  # between SIGTERM and SIGKILL for the processes of a stopping worker's group


class Bootstrap(Protocol):
    """What every child's bootstrap carries: its parent's `sys.path`."""

    sys_path: list[str]


B = TypeVar("B", bound=Bootstrap)


@dataclass
class Child:
    """A started child process and the report it sent when it became ready."""

    process: subprocess.Popen[bytes]
    report: dict[str, Any]
    own_group: bool = False  # it leads a process group of its own: stopping it stops the group
    _asking: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1), repr=False)
    _buffer: bytes = field(default=b"", repr=False)  # what was read of the answers past the last line taken

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(self, message: bytes, timeout_s: float, *, withdraw_timeout_s: float = WITHDRAW_TIMEOUT_S) -> dict[str, Any]:
        """Send a message (a frame, as the bootstrap, under an id of its own) to a child spawned with
        `messages=True`, and return its JSON answer; one at a time. An answer to an earlier message, which
        came after its asker gave up, is discarded (logged).

        Not answered within `timeout_s`, the message is withdrawn: the child's handler learns it
        (`Message.on_withdraw`) and answers at once whether what it asked was applied. Applied, its answer
        is returned as if in time; else this raises.

        Raises:
            PatchkitError: the error the child answered with; or the message was withdrawn and nothing it
                asked for was applied.
            WorkerDiedError: the child is gone, or it answered neither the message nor its withdrawal
                (within `withdraw_timeout_s` more): whether it was applied is not known.
        """
        stdin, stdout = self.process.stdin, self.process.stdout
        with self._asking:
            if stdin is None or stdout is None or stdout.closed or not self.alive():
                raise WorkerDiedError("the child process is gone, or takes no messages")
            message_id = next(self._ids)
            try:
                self._send(message_id, _ASK, message)
                answer = self._answer(message_id, timeout_s)
                if answer is None:
                    logger.warning("no answer to message %d within %g s: withdrawing it", message_id, timeout_s)
                    self._send(message_id, _WITHDRAW, b"")
                    answer = self._answer(message_id, withdraw_timeout_s)
            except OSError as exc:
                raise WorkerDiedError(f"no answer from the child process: {exc}") from None
        if answer is None:
            raise WorkerDiedError(f"no answer from the child process within {timeout_s:g} s, nor to the message's "
                                  f"withdrawal within {withdraw_timeout_s:g} s more: whether it was applied is not known")
        if answer.get("withdrawn"):
            raise PatchkitError(f"no answer within {timeout_s:g} s: the message was withdrawn, and nothing it asked for "
                                "was applied")
        if "error" in answer:
            raise error_from_json(answer["error"])
        return answer

    def _send(self, message_id: int, kind: bytes, body: bytes) -> None:
        assert self.process.stdin is not None
        header = message_id.to_bytes(_LENGTH, "big") + kind
        _write_frame(self.process.stdin, header, body)

    def _answer(self, message_id: int, timeout_s: float) -> dict[str, Any] | None:
        """The answer to message `message_id` (None: none within `timeout_s`); those to earlier ones are dropped."""
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line, self._buffer = _next_line(self.process.stdout, self._buffer, deadline)
            except TimeoutError:
                return None
            if not line:
                raise WorkerDiedError("the child process exited before it answered")
            answer: dict[str, Any] = json.loads(line)
            if answer.get("id") == message_id:
                return answer
            logger.warning("discarded a late answer to message %s (message %d waits for its own): %.200s",
                           answer.get("id"), message_id, line.decode(errors="replace").strip())

    def stop(self, timeout_s: float) -> None:
        """Cut the lifeline, give the child `timeout_s` to exit, then SIGKILL it; always reaps it.
        A child with a process group of its own has every process of the group stopped too."""
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except OSError:
                    pass
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.own_group:
            stop_group(self.process.pid, GROUP_GRACE_S)


def spawn(
    module: str,
    bootstrap: bytes,
    *,
    what: str,
    env: dict[str, str] | None = None,
    timeout_s: float,
    own_group: bool = False,
    messages: bool = False,
) -> Child:
    """Start `python -m module`, send it `bootstrap`, and wait for its ready report.

    Raises the error the child reported (as a PatchkitError) or WorkerDiedError when it exits or
    stays silent past `timeout_s`; the child is gone in both cases. `what` names it in messages.
    `own_group`: start it in a session and process group of its own, which the processes it starts
    share, and which `Child.stop` stops with it. `messages`: it answers `Child.ask` (its stdout stays open).
    """
    process = subprocess.Popen(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **(env or {})},
        start_new_session=own_group,
    )
    child = Child(process, {}, own_group)
    assert process.stdin is not None and process.stdout is not None
    line = b""
    try:
        _write_frame(process.stdin, b"", bootstrap)
        line = _read_line(process.stdout, timeout_s)
    except (OSError, TimeoutError) as exc:
        child.stop(0)
        raise WorkerDiedError(f"{what} did not start: {exc}") from None
    finally:
        if not messages or not line:
            process.stdout.close()
    if not line:
        code = process.wait()
        if own_group:
            stop_group(process.pid, GROUP_GRACE_S)
        raise WorkerDiedError(f"{what} exited with code {code} before it was ready; its stderr above says why")
    report = json.loads(line)
    if "error" in report:
        child.stop(0)
        raise error_from_json(report["error"])
    child.report = report
    return child


def _write_frame(stream: IO[bytes], header: bytes, body: bytes) -> None:
    """`header` and `body` as one length-prefixed frame, the body written as it is (never copied into the frame)."""
    stream.write((len(header) + len(body)).to_bytes(_LENGTH, "big") + header)
    stream.write(body)
    stream.flush()


def _read_exactly(stream: io.RawIOBase, size: int) -> memoryview | None:
    """Exactly `size` bytes of `stream`, read in place into one buffer (linear in `size`, however the pipe splits
    them); None at end of file before them."""
    buffer = memoryview(bytearray(size))
    filled = 0
    while filled < size:
        count = stream.readinto(buffer[filled:])
        if not count:
            return None
        filled += count
    return buffer


def _read_line(stream: IO[bytes], timeout_s: float) -> bytes:
    try:
        return _next_line(stream, b"", time.monotonic() + timeout_s)[0]
    except TimeoutError:
        raise TimeoutError(f"no ready report within {timeout_s:g} s (PATCHKIT_WORKER_START_TIMEOUT_S)") from None


def _next_line(stream: IO[bytes], before: bytes, deadline: float) -> tuple[bytes, bytes]:
    """The next line of `stream`, `before` read before it (b"" at end of file), and what was read past it."""
    fd = stream.fileno()
    data = bytearray(before)
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return bytes(data), b""
            data += chunk  # a bytearray grows in place: linear in the line's length
    line, _, rest = bytes(data).partition(b"\n")
    return line + b"\n", rest


def stop_group(pgid: int, grace_s: float, *, spare: int | None = None) -> None:
    """Stop every process of group `pgid` but `spare`: SIGTERM, then SIGKILL those left after `grace_s`.

    Called by a parent once its child that led the group has exited, and by that child itself
    (sparing itself) as its lifeline ends. Reads the members from /proc; where there is none, the
    group is sent SIGKILL whole, `spare` included.
    """
    members = _members(pgid, spare)
    if members is None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in members:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        while members and time.monotonic() < deadline and sig == signal.SIGTERM:
            time.sleep(0.02)
            members = _members(pgid, spare) or []
        if not members:
            return


def _members(pgid: int, spare: int | None) -> list[int] | None:
    """The running (not zombie) processes of group `pgid` but `spare`, from /proc; None without /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == spare:
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # the command name, in parentheses, may hold spaces
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


class ChildSide:
    """The child's half: read the bootstrap, watch the lifeline, send the ready report once."""

    def __init__(self) -> None:
        # The report goes to the original stdout; everything the child prints goes to stderr.
        self._report = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        self._stdin = os.fdopen(0, "rb", buffering=0)
        self._handler: Callable[[Message], dict[str, Any]] | None = None
        self._reported = False
        self._answering = threading.Lock()
        self._open: dict[int, Message] = {}  # the messages being answered, by id

    def start(self, kind: type[B]) -> B:
        """Read the bootstrap, a pickled `kind`, then watch the lifeline and take the parent's `sys.path`
        (this one's when that is empty), so that what the bootstrap's payloads name imports here too.

        Called first thing by a child's `main`: the worker's and the front-end's.
        """
        frame = self._frame()
        if frame is None:
            os._exit(0)  # the parent went away before we started
        boot = pickle.loads(frame)  # noqa: S301 - from our parent, over a private pipe
        self._watch_lifeline()
        sys.path[:] = boot.sys_path or sys.path
        # `kind` types the answer only: run as `python -m`, the child's own module is `__main__`, so
        # the class it names is not the one the bootstrap unpickles to.
        return cast(B, boot)

    def _watch_lifeline(self) -> None:
        """Exit at once when the parent closes stdin or dies; a child in a session of its own (a worker)
        first stops the processes of its group (what its component started). Frames the parent sends
        meanwhile go to the `answer_with` handler, each on a thread of its own; a withdrawal, to the message's
        `on_withdraw` callbacks."""
        leads_session = os.getsid(0) == os.getpid()

        def watch() -> None:
            while (frame := self._frame()) is not None:
                message_id, kind = int.from_bytes(frame[:_LENGTH], "big"), bytes(frame[_LENGTH:_LENGTH + 1])
                body = frame[_LENGTH + 1:]
                if kind == _WITHDRAW:
                    if (message := self._open.get(message_id)) is not None:
                        message.withdraw()
                elif self._handler is not None:
                    message = self._open[message_id] = Message(message_id, body)
                    threading.Thread(target=self._answer, args=(self._handler, message), daemon=True).start()
            if leads_session:
                stop_group(os.getpid(), GROUP_GRACE_S, spare=os.getpid())
            os._exit(0)

        threading.Thread(target=watch, name="patchkit-lifeline", daemon=True).start()
        # Ctrl-C in the user's terminal reaches the whole process group: the parent decides when we stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _frame(self) -> memoryview | None:
        """The next length-prefixed frame on the lifeline, read in place; None at its end."""
        size = _read_exactly(self._stdin, _LENGTH)
        return None if size is None else _read_exactly(self._stdin, int.from_bytes(size, "big"))

    def answer_with(self, handler: Callable[[Message], dict[str, Any]]) -> None:
        """Answer the parent's messages (`Child.ask`) with `handler`'s JSON answer, or the error it raised; set
        before `ready`, which then leaves the report stream open for the answers. A handler that gives up on a
        withdrawn message (`Message.on_withdraw`) with nothing applied raises CancelledError: the answer says
        "withdrawn"; one that applied it anyway returns its answer."""
        self._handler = handler

    def _answer(self, handler: Callable[[Message], dict[str, Any]], message: Message) -> None:
        try:
            answer = handler(message)
        except (asyncio.CancelledError, concurrent.futures.CancelledError) as exc:
            if message.withdrawn:
                answer = {"withdrawn": True}
            else:
                answer = {"error": error_to_json(PatchkitError(f"cancelled: {exc}"), traceback=False)}
        except BaseException as exc:
            error = exc if isinstance(exc, PatchkitError) else PatchkitError(f"{type(exc).__name__}: {exc}")
            answer = {"error": error_to_json(error, traceback=False)}
        self._open.pop(message.id, None)
        with self._answering:
            self._report.write(json.dumps({"id": message.id, **answer}) + "\n")
            self._report.flush()

    def ready(self, **report: Any) -> None:
        self._send(report)

    def failed(self, error: BaseException) -> None:
        if not isinstance(error, PatchkitError):
            error = WorkerDiedError(f"{type(error).__name__}: {error}")
        self._send({"error": error_to_json(error)})

    def _send(self, report: dict[str, Any]) -> None:
        if self._report.closed or self._reported:
            return  # already reported: a later failure is the process's own stderr's business
        self._reported = True
        self._report.write(json.dumps(report) + "\n")
        if self._handler is None or "error" in report:
            self._report.close()
        else:
            self._report.flush()


class Message:
    """A message from the parent (`Child.ask`), as the child's handler gets it: its `id`, its `body` (a buffer, as read in
    place: `pickle.loads` takes it; `bytes()` copies it), and whether
    the parent withdrew it (no answer in time), which `on_withdraw` callbacks hear of on the lifeline's thread."""

    def __init__(self, message_id: int, body: memoryview) -> None:
        self.id = message_id
        self.body = body
        self.withdrawn = False
        self._callbacks: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    def on_withdraw(self, callback: Callable[[], object]) -> None:
        """Call `callback` once the parent withdraws the message (at once if it has)."""
        with self._lock:
            if not self.withdrawn:
                self._callbacks.append(callback)
                return
        callback()

    def withdraw(self) -> None:
        """Called by the lifeline's watcher when the parent withdraws the message."""
        with self._lock:
            self.withdrawn, callbacks, self._callbacks = True, self._callbacks, []
        for callback in callbacks:
            callback()
