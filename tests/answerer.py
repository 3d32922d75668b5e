"""A child process that answers its parent's messages (`ChildSide.answer_with`), for the tests of the update channel.

Each message is JSON `{"text": ..., "wait_s": ..., "stubborn": ...}`: the answer `{"echo": text}` comes after
`wait_s`; withdrawn before then, the message is given up (CancelledError: nothing applied), unless it is
`stubborn`, which answers when its wait ends whatever the parent said.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from typing import TYPE_CHECKING, Any

from patchkit.orchestrator.process import ChildSide

if TYPE_CHECKING:
    from patchkit.orchestrator.process import Message


def answer(message: Message) -> dict[str, Any]:
    asked = json.loads(bytes(getattr(message, "body", message)))  # a buffer read in place (before message ids: bytes)
    withdrawn = threading.Event()
    if not asked.get("stubborn") and hasattr(message, "on_withdraw"):
        message.on_withdraw(withdrawn.set)
    if withdrawn.wait(asked.get("wait_s", 0.0)):
        raise concurrent.futures.CancelledError("withdrawn before it was applied")
    return {"echo": asked["text"]}


def main() -> None:
    side = ChildSide()
    side.start(object)  # type: ignore[type-var]  # the bootstrap is a SimpleNamespace with sys_path
    side.answer_with(answer)
    side.ready(pid=0)
    while True:  # the lifeline's watcher exits the process when the parent closes stdin
        time.sleep(3600)


if __name__ == "__main__":
    main()
