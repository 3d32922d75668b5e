"""`BatchEngine`: the engine thread behind `TransformersGenerator`, which batches the calls that arrive
together into one `model.generate` and streams each row's new tokens back to its caller.

Calls come from many threads at once (a worker runs each call of a `max_concurrency` method in a
thread of its own). Each submits a `Row` and waits on it; the engine thread takes every row waiting
(up to `max_batch`) into one left-padded batch, decodes it to the end, and only then takes the rows
that arrived meanwhile: transformers' `generate` cannot admit a sequence into a running batch.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["BatchEngine", "Row"]

logger = logging.getLogger(__name__)


class Row:
    """One call in the engine: its prompt's token ids, its token limit, how it samples, and the queue its new
    tokens go to.

    The engine thread puts lists of token ids, then None at the end or the exception that ended the
    batch; the caller's thread reads them and sets `closed` when it stops reading early."""

    def __init__(self, prompt: list[int], max_tokens: int, decoding: dict[str, Any] | None = None, seed: int = 0) -> None:
        self.prompt, self.max_tokens = prompt, max_tokens
        self.decoding, self.seed = decoding or {"do_sample": False}, seed  # `generate`'s sampling keywords, its seed
        self.output: queue.SimpleQueue[list[int] | BaseException | None] = queue.SimpleQueue()
        self.generated = 0
        self.done = False  # written by the engine thread only
        self.cut = False  # ended by the engine because its caller had closed it
        self.closed = False  # written by the caller's thread only, when it stops reading before the end

    @property
    def sampled_alike(self) -> tuple[Any, ...]:
        """What rows sharing a batch must have alike: `generate` samples a whole batch one way, from one seed."""
        greedy = not self.decoding.get("do_sample")
        return (tuple(sorted(self.decoding.items())), None if greedy else self.seed)

    def take(self, token: int, stop_ids: set[int]) -> None:
        """A new token for this row, from the engine thread: passed on, or the row's end."""
        if self.done:
            return
        if self.closed or token in stop_ids:
            self.cut = self.closed
            self.finish()
            return
        self.output.put([token])
        self.generated += 1
        if self.generated >= self.max_tokens:
            self.finish()

    def finish(self, error: BaseException | None = None) -> None:
        if not self.done:
            self.done = True
            self.output.put(error)


class BatchEngine:
    """Runs `model.generate` over batches of waiting rows, on a daemon thread of its own started here.

    Each row says how it samples (`generate`'s sampling keywords and a seed); a batch holds rows that
    sample alike. `seeded(seed)`: a context manager that seeds each batch (a sampled answer depends on the
    rows it shares its batch with, a greedy one does not).
    A row ends at any of `stop_ids`, at its own `max_tokens`, or when its caller closes its stream: a
    closed row is dropped from the batch at the next step (it stops counting towards the batch's end;
    transformers still computes its padded row until the whole batch ends).
    """

    def __init__(
        self,
        model: Any,
        *,
        pad_id: int,
        stop_ids: set[int],
        seeded: Callable[[int], contextlib.AbstractContextManager[None]],
        max_batch: int,
    ) -> None:
        self.model, self.pad_id, self.stop_ids = model, pad_id, stop_ids
        self.seeded, self.max_batch = seeded, max_batch
        self._waiting: deque[Row] = deque()
        self._ready = threading.Condition()
        self._counts = {"batches": 0, "rows": 0, "steps": 0, "tokens": 0, "closed_early": 0}
        self._thread = threading.Thread(target=self._serve, name="patchkit-transformers", daemon=True)
        self._thread.start()

    def stream(self, prompt: list[int], max_tokens: int, decoding: dict[str, Any] | None = None,
               seed: int = 0) -> Iterator[list[int]]:
        """The new token ids of one prompt as the engine makes them, a list at a time (every id that
        arrived since the last one), sampled with `decoding` (`generate`'s keywords; None: greedy) from
        `seed`. Called from the caller's own thread; closing the iterator early takes the row out of its batch."""
        row = Row(prompt, max_tokens, decoding, seed)
        with self._ready:
            self._waiting.append(row)
            self._ready.notify()
        ended = False
        try:
            while (item := row.output.get()) is not None:
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                while not row.output.empty():  # what else came while this thread was busy: one decode for all
                    more = row.output.get_nowait()
                    if not isinstance(more, list):
                        row.output.put(more)  # the end, read by the outer loop next
                        break
                    item += more
                yield item
            ended = True
        finally:
            row.closed = not ended

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        """Batches run, rows they held, decode steps, tokens passed on, and rows their callers closed before their end."""
        with self._ready:
            return dict(self._counts)

    def _serve(self) -> None:
        while True:
            rows = self._take()
            try:
                self._generate(rows)
            except Exception as exc:  # every row of the batch fails with it; the engine goes on to the next
                logger.debug("a batch of %d rows failed: %r", len(rows), exc)
                for row in rows:
                    row.finish(exc)
            for row in rows:
                row.finish()  # generate ended: every row is, whatever the reason
            with self._ready:
                self._counts["closed_early"] += sum(row.cut for row in rows)

    def _take(self) -> list[Row]:
        """Every waiting row that is still wanted and samples as the first does, up to `max_batch`; blocks until
        there is one. The others keep their places."""
        with self._ready:
            while True:
                rows: list[Row] = []
                others: list[Row] = []
                while self._waiting and len(rows) < self.max_batch:
                    row = self._waiting.popleft()
                    if row.closed:
                        self._counts["closed_early"] += 1
                    elif rows and row.sampled_alike != rows[0].sampled_alike:
                        others.append(row)
                    else:
                        rows.append(row)
                self._waiting.extendleft(reversed(others))
                if rows:
                    self._counts["batches"] += 1
                    self._counts["rows"] += len(rows)
                    return rows
                self._ready.wait()

    def _generate(self, rows: list[Row]) -> None:
        import torch
        from transformers import StoppingCriteriaList

        width = max(len(row.prompt) for row in rows)
        # Left padding: every prompt ends where the batch's new tokens begin, so one step decodes the whole batch.
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row.prompt) :] = torch.tensor(row.prompt, dtype=torch.long)
            mask[i, width - len(row.prompt) :] = 1
        device = self.model.device
        with torch.inference_mode(), self.seeded(rows[0].seed):
            self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(row.max_tokens for row in rows),
                pad_token_id=self.pad_id,
                streamer=_RowStreamer(self, rows),
                stopping_criteria=StoppingCriteriaList([_RowsDone(rows, width)]),
                **rows[0].decoding,
            )

    def _count_step(self, tokens: int) -> None:
        with self._ready:
            self._counts["steps"] += 1
            self._counts["tokens"] += tokens


class _RowStreamer:
    """The streamer `generate` hands each step's new tokens to, one per row of the batch: it splits them
    per row. (transformers' own streamers take a batch of one; the interface is `put` and `end`.)"""

    def __init__(self, engine: BatchEngine, rows: list[Row]) -> None:
        self.engine, self.rows = engine, rows

    def put(self, value: Any) -> None:
        if value.dim() > 1:  # the first call carries the prompts
            return
        before = sum(row.generated for row in self.rows)
        for row, token in zip(self.rows, value.tolist()):
            row.take(token, self.engine.stop_ids)
        self.engine._count_step(sum(row.generated for row in self.rows) - before)

    def end(self) -> None:
        for row in self.rows:
            row.finish()


class _RowsDone:
    """Which rows are finished, a stopping criterion `generate` checks after every step: a row whose caller
    closed its stream, or that reached its own `max_tokens` (the batch runs to the largest). With every row
    finished, the batch ends."""

    def __init__(self, rows: list[Row], width: int) -> None:
        self.rows, self.width = rows, width

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        generated = input_ids.shape[1] - self.width
        done = [row.closed or row.done or generated >= row.max_tokens for row in self.rows]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)
