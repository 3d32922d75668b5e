"""Parallel calls: deployed, a request's independent component calls overlap, and it still answers and
fails exactly as the same code run as plain Python.

The corpus, re-run on inputs that make its components fail, raises what plain Python raises; each rule
of the rewrite holds on the default (local) backend: independent calls run at once (their replicas'
clocks overlap) unless `parallel_calls=False` or `ordered=True`, a comprehension reaches its method as
one batch, the earliest failing call's error wins even when a later one failed first, an `except`
catches the call it guards and nothing after it runs, user code with effects never runs past a call
plain Python would have stopped at, the output streams while other calls are in flight, and a request
that ends stops all its calls.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from components import Streamer
from corpus import CASES, Case
from serving import run_frontend
from test_concurrency import Teller
from test_frontend import capture_case

import patchkit
from patchkit import Component, make
from patchkit.scheduler.online.frontend import Frontend

ACKS = Path(tempfile.mkdtemp(prefix="patchkit-parallel-acks-"))
MARKS = Path(tempfile.mkdtemp(prefix="patchkit-parallel-marks-"))


@pytest.fixture(scope="module", autouse=True)
def _remove_dirs() -> Iterator[None]:
    yield
    shutil.rmtree(ACKS, ignore_errors=True)
    shutil.rmtree(MARKS, ignore_errors=True)


class Clock(Component):
    """Takes `seconds` a call and answers with when it ran, on the machine's wall clock."""

    def __init__(self, seconds: float = 0.4) -> None:
        self.seconds = seconds

    @make(read_only=True)
    def span(self, tag: str) -> list[float]:
        start = time.time()
        time.sleep(self.seconds)
        return [start, time.time()]

    @make(ordered=True)
    def logged(self, tag: str) -> list[float]:
        start = time.time()
        time.sleep(self.seconds)
        return [start, time.time()]

    @make(batch=True, read_only=True)
    def sizes(self, tag: list[str]) -> list[int]:
        time.sleep(self.seconds)
        return [len(tag)] * len(tag)


class Fails(Component):
    """Raises `kind(text)` after `seconds`, as a model call that errors out late (or at once)."""

    def __init__(self, seconds: float, kind: type[Exception]) -> None:
        self.seconds, self.kind = seconds, kind

    @make(read_only=True)
    def run(self, text: str) -> str:
        time.sleep(self.seconds)
        raise self.kind(f"{type(self).__name__} {self.kind.__name__} on {text}")


class Marks(Component):
    """Leaves a file per call in MARKS (named by its text): whether a call ran at all, seen from the test."""

    @make
    def mark(self, text: str) -> str:
        (MARKS / text).touch()
        return text


first_clock, second_clock, third_clock = Clock(), Clock(), Clock()
late_lookup, early_value = Fails(0.8, LookupError), Fails(0.0, ValueError)
marks = Marks()


def overlapped(tag: str, one: Clock = first_clock, two: Clock = second_clock) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        first = one.span(tag)
        second = two.span(tag + "!")
        return [first, second]
    return pipeline


def ordered(tag: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        first = first_clock.span(tag)
        second = second_clock.logged(tag)
        third = third_clock.span(tag)
        return [first, second, third]
    return pipeline


def batched(tag: str, parts: list[str]) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        sizes = [first_clock.sizes(tag + p) for p in parts]
        return sizes
    return pipeline


def earlier_error_wins(text: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        slow = late_lookup.run(text)
        fast = early_value.run(text)
        return slow + fast
    return pipeline


def local_error_after_a_call(text: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        slow = late_lookup.run(text)
        number = int(text)  # local work in the window raises too; plain Python never gets here
        return [slow, number]
    return pipeline


def guarded(text: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        before = first_clock.span(text)
        try:
            failed = late_lookup.run(text)
            after = marks.mark(text + "-after")
        except LookupError as error:
            failed, after = "caught " + type(error).__name__, "skipped"
        return [failed, after, len(before)]
    return pipeline


def with_effect(text: str, path: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        failed = late_lookup.run(text)
        open(path, "w").close()  # user code with an effect: never run where plain Python would have stopped
        other = marks.mark(text)
        return [failed, other]
    return pipeline


def overlaps(spans: list[list[float]]) -> bool:
    """Whether the second call started before the first ended: both were in flight at once."""
    (_, first_end), (second_start, _) = spans[0], spans[1]
    return second_start < first_end


def fresh(prefix: str = "q") -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


# -- the corpus: outputs and exceptions as plain Python's -------------------------------------------
def boom(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs with every string holding "boom", so that the corpus components called on them fail."""
    return {k: (f"{v} boom" if isinstance(v, str) else v) for k, v in inputs.items()}


def outcome(run: Any) -> tuple[str, Any]:
    try:
        return "output", json.loads(json.dumps(run()))
    except Exception as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_corpus_answers_and_fails_as_plain_python_with_parallel_calls(case: Case) -> None:
    pipeline, _ = capture_case(case)
    runs = case.inputs + [boom(inputs) for inputs in case.inputs]
    expected = [outcome(lambda inputs=inputs: pipeline(**inputs)) for inputs in runs]

    async def body(frontend: Frontend) -> list[tuple[str, Any]]:
        got = []
        for inputs in runs:
            try:
                got.append(("output", json.loads(json.dumps((await frontend.query(inputs)).output))))
            except Exception as exc:
                got.append((type(exc).__name__, str(exc)))
        return got

    assert run_frontend(pipeline, body, parallel_calls=True, optional_inputs=tuple(pipeline.inputs)) == expected


def test_the_failing_inputs_make_most_of_the_corpus_fail() -> None:
    """The test above compares errors, not only outputs: most cases raise on their "boom" inputs."""
    raising = 0
    for case in CASES:
        pipeline, _ = capture_case(case)
        raising += any(outcome(lambda i=i, p=pipeline: p(**i))[0] != "output" for i in map(boom, case.inputs))
    assert raising >= 30, raising


# -- what the graph says may overlap ----------------------------------------------------------------
def labels(pipeline: patchkit.Pipeline) -> list[list[str]]:
    nodes = pipeline.graph.nodes
    return [[nodes[n].label for n in group] for group in pipeline.graph.overlap_groups]


def test_the_graph_groups_the_calls_that_may_be_in_flight_together() -> None:
    assert labels(overlapped("x")) == [["one.span", "two.span"]]
    assert labels(batched("x", ["a"])) == [["first_clock.sizes"]]  # with itself: a loop issues it again
    assert labels(ordered("x")) == []  # the ordered call waits for the first and is waited for
    assert labels(guarded("x")) == []  # calls in a try run one at a time
    assert labels(with_effect("x", "p")) == []  # user code with effects closes the window
    graph = overlapped("x").graph.to_json()
    assert graph["overlap_groups"] == [["n0", "n1"]]


def diamond(text: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        top = first_clock.span(text)
        left = second_clock.span(str(top))
        right = third_clock.span(str(top[0]))
        return first_clock.span(str(left) + str(right))
    return pipeline


def chain(text: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        one = first_clock.span(text)
        two = second_clock.span(str(one))
        return third_clock.span(str(two))
    return pipeline


def test_a_diamond_overlaps_its_two_sides_and_a_chain_nothing() -> None:
    assert labels(diamond("x")) == [["second_clock.span", "third_clock.span"]]
    assert labels(chain("x")) == []


class Quick(Component):
    @make(read_only=True)
    def fetch(self, text: str) -> list[str]:
        return [text, text.upper()]


quick_one, quick_two = Quick(), Quick()


def inspected(text: str) -> str:
    with patchkit.capture():
        docs = quick_one.fetch(text)
        more = quick_two.fetch(text + "!")
        seen = [isinstance(docs, list), docs is more, docs == more, len(docs) + len(more), more[1] + "?"]
        return json.dumps([docs, more, seen])


def test_code_between_a_call_and_its_use_sees_the_result_itself() -> None:
    inspected("abc")
    pipeline = patchkit.last_pipeline()
    assert labels(pipeline) == [["quick_one.fetch", "quick_two.fetch"]]
    expected = pipeline(text="xyz")

    async def body(frontend: Frontend) -> Any:
        return (await frontend.query({"text": "xyz"})).output

    assert run_frontend(pipeline, body) == expected == '[["xyz", "XYZ"], ["xyz!", "XYZ!"], [true, false, false, 4, "XYZ!?"]]'


def test_the_eager_pipeline_stays_sequential() -> None:
    pipeline = overlapped("x", Clock(0.05), Clock(0.05))
    assert not overlaps(pipeline(tag="y"))


# -- the rules on the default backend ---------------------------------------------------------------
@pytest.mark.slow
def test_independent_calls_overlap_unless_turned_off_or_ordered() -> None:
    with patchkit.deploy(overlapped("x")) as endpoint:
        assert overlaps(endpoint.query(tag=fresh()))
    with patchkit.deploy(overlapped("x"), parallel_calls=False) as endpoint:
        assert not overlaps(endpoint.query(tag=fresh()))
    with patchkit.deploy(ordered("x")) as endpoint:
        first, second, third = endpoint.query(tag=fresh())
        assert second[0] >= first[1] and third[0] >= second[1]  # the ordered call waited, and was waited for


@pytest.mark.slow
def test_a_comprehension_reaches_its_method_as_one_batch() -> None:
    parts = ["a", "b", "c", "d"]
    with patchkit.deploy(batched("x", parts)) as endpoint:
        assert endpoint.query(tag=fresh(), parts=parts) == [4, 4, 4, 4]
    with patchkit.deploy(batched("x", parts), parallel_calls=False) as endpoint:
        assert endpoint.query(tag=fresh(), parts=parts) == [1, 1, 1, 1]


@pytest.mark.slow
def test_the_earliest_call_s_error_wins_though_a_later_one_failed_first() -> None:
    pipeline = earlier_error_wins("x")
    with pytest.raises(LookupError, match="LookupError on y"):
        pipeline(text="y")  # plain Python: the first call raises; the second never runs

    async def body(frontend: Frontend) -> None:
        with pytest.raises(LookupError, match="LookupError on z"):
            await frontend.query({"text": "z"})

    run_frontend(pipeline, body, backend="local")
    run_frontend(local_error_after_a_call("x"), body, backend="local")
    with patchkit.deploy(pipeline) as endpoint, pytest.raises(patchkit.ComponentError, match="LookupError") as caught:
        endpoint.query(text=fresh())
    assert "ValueError" not in str(caught.value)


@pytest.mark.slow
def test_an_except_catches_its_call_and_nothing_after_it_runs() -> None:
    text = fresh()
    with patchkit.deploy(guarded("x")) as endpoint:
        assert endpoint.query(text=text) == ["caught LookupError", "skipped", 2]
    assert not (MARKS / f"{text}-after").exists()


@pytest.mark.slow
def test_user_code_with_effects_never_runs_past_a_call_that_fails(tmp_path: Path) -> None:
    path = tmp_path / "effect"
    with patchkit.deploy(with_effect("x", str(path))) as endpoint:
        with pytest.raises(patchkit.ComponentError, match="LookupError"):
            endpoint.query(text=fresh(), path=str(path))
    assert not path.exists()
    assert not any(MARKS.iterdir())  # nor did the call after it


streamer = Streamer(ack_dir=str(ACKS))
question = "What is a generator?"
with patchkit.capture(run=False, output="answer") as streamed_beside_others:  # module level, as scripts write it
    spans = first_clock.span(question)
    more = second_clock.span(question)
    answer = streamer.generate(question)


@pytest.mark.slow
def test_the_output_streams_while_other_calls_are_in_flight() -> None:
    assert labels(streamed_beside_others) == [["first_clock.span", "second_clock.span", "streamer.generate"]]
    asked = fresh()
    with patchkit.deploy(streamed_beside_others) as endpoint:
        stream = endpoint.stream(question=asked)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            (ACKS / asked).touch()
    assert len(chunks) >= 2 and "".join(chunks) == stream.output == f"Answer to {asked} is read"


def told(text: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        first = first_teller.tell(text)
        second = second_teller.tell(text)
        return first + second
    return pipeline


first_teller, second_teller = Teller(pause_s=0.2), Teller(pause_s=0.2)


@pytest.mark.slow
def test_a_request_that_ends_stops_all_its_calls_in_flight() -> None:
    async def body(frontend: Frontend) -> list[dict[str, Any]]:
        task = asyncio.ensure_future(frontend.query({"text": " ".join(["w"] * 100)}))
        await asyncio.sleep(2.0)  # both calls are running at their workers by now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.0)  # each worker stops its call at its next chunk
        return [report["component_stats"] for report in (await frontend.replica_stats()).values()]

    reports = run_frontend(told("x"), body, backend="local")
    assert reports == [{"closed_early": 1, "finished": 0}] * 2
