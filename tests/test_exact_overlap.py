"""Parallel calls never change what a pipeline computes or does, on the default (local) backend and inprocess.

Each pipeline here does what overlapping calls could get wrong: a write through one component and a read of
it through another (a file they share), two methods of one component (an add, then a search), an effect
after a call that fails, an argument extended, merged or multiplied after the call, a key function or a
builtin that runs user code while calls are open, a component's own TimeoutError, and an output streamed
through a helper. Each is compared with the same code run as plain Python (`pipeline(...)`), on inputs
the code has not seen, with captures written at module level and inside functions, as the docs write them.
"""

from __future__ import annotations

import copy
import gc
import json
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from components import Streamer
from test_parallel_rewrite import run_parallel

import patchkit
from patchkit import Component, make

STORE = Path(tempfile.mkdtemp(prefix="patchkit-exact-store-"))
ACKS = Path(tempfile.mkdtemp(prefix="patchkit-exact-acks-"))
BACKENDS = [pytest.param("local", marks=pytest.mark.slow), "inprocess"]


@pytest.fixture(scope="module", autouse=True)
def _remove_dirs() -> Iterator[None]:
    yield
    shutil.rmtree(STORE, ignore_errors=True)
    shutil.rmtree(ACKS, ignore_errors=True)


class Writer(Component):
    """Writes a value to a file in `store` after a pause, as a store's write takes its time."""

    def __init__(self, store: str, pause_s: float = 0.3) -> None:
        self.store, self.pause_s = Path(store), pause_s

    @make
    def put(self, key: str, value: int) -> None:
        time.sleep(self.pause_s)
        (self.store / key).write_text(str(value))


class Reader(Component):
    """Reads what a Writer wrote: None before it did."""

    def __init__(self, store: str) -> None:
        self.store = Path(store)

    @make(read_only=True)
    def get(self, key: str) -> int | None:
        path = self.store / key
        return int(path.read_text()) if path.exists() else None


class Memory(Component):
    """A conversation memory on a file: `add` writes (after a pause), `search` reads."""

    def __init__(self, store: str, pause_s: float = 0.3) -> None:
        self.store, self.pause_s = Path(store), pause_s

    @make
    def add(self, key: str, turn: str) -> int:
        time.sleep(self.pause_s)
        with (self.store / key).open("a") as f:
            f.write(turn + "\n")
        return len(turn)

    @make(read_only=True)
    def search(self, key: str) -> list[str]:
        path = self.store / key
        return path.read_text().split("\n")[:-1] if path.exists() else []


class Checker(Component):
    """Fails after a pause on a text holding "bad", as a model call that errors out late."""

    @make(read_only=True)
    def check(self, text: str) -> str:
        time.sleep(0.3)
        if "bad" in text:
            raise LookupError(f"no entry for {text!r}")
        return text.upper()


class Echo(Component):
    """Answers with what it was given, as it was when the call reached it (its repr); `hold` keeps the
    replica busy first, so that a call waits in its queue while the pipeline's code goes on."""

    @make(read_only=True)
    def echo(self, value: Any) -> str:
        time.sleep(0.05)
        return repr(value)

    @make(read_only=True)
    def hold(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @make(read_only=True)
    def span(self, seconds: float) -> list[float]:
        """When it ran, on the machine's wall clock."""
        start = time.time()
        time.sleep(seconds)
        return [start, time.time()]


class Fetcher(Component):
    """Raises its own TimeoutError, as a socket or a future that timed out does."""

    @make(read_only=True)
    def fetch(self, url: str) -> str:
        raise TimeoutError(f"reading {url} timed out")


writer, reader, memory = Writer(str(STORE)), Reader(str(STORE)), Memory(str(STORE))
checker, echo, other_echo, fetcher = Checker(), Echo(), Echo(), Fetcher()
streamer = Streamer(ack_dir=str(ACKS))


def fresh(prefix: str = "k") -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def outcome(run: Any) -> tuple[str, Any]:
    try:
        return "output", run()
    except patchkit.ComponentError as exc:  # deployed: "checker.check raised: LookupError: its text"
        kind, text = str(exc).split(" raised: ", 1)[1].split(": ", 1)
        return kind, text
    except Exception as exc:
        return type(exc).__name__, str(exc)


def deployed(pipeline: patchkit.Pipeline, backend: str, inputs: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    with patchkit.deploy(pipeline, backend=backend) as endpoint:
        return [outcome(lambda i=i: endpoint.query(**i)) for i in inputs]


# -- effects keep plain Python's order ---------------------------------------------------------------


def write_then_read(key: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        writer.put(key, len(key))  # made for its effect: its result goes nowhere
        seen = reader.get(key)
        return [key, seen]
    return pipeline


key, turn = "k", "hello"
with patchkit.capture(run=False, output="hits") as remember_then_search:  # module level, as scripts write it
    added = memory.add(key, turn)  # its result is kept, and still it comes first
    hits = memory.search(key)


def fails_then_writes(key: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        checked = checker.check(key)
        writer.put(key, 7)  # plain Python never gets here when the check fails
        return [checked, reader.get(key)]
    return pipeline


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_then_a_read_through_two_components_reads_what_was_written(backend: str) -> None:
    keys = [fresh() for _ in range(2)]
    assert deployed(write_then_read("x"), backend, [{"key": k} for k in keys]) == [("output", [k, len(k)]) for k in keys]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_methods_of_one_component_keep_their_order(backend: str) -> None:
    key = fresh()
    got = deployed(remember_then_search, backend, [{"key": key, "turn": "first"}, {"key": key, "turn": "second"}])
    assert got == [("output", ["first"]), ("output", ["first", "second"])]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_after_a_failed_one_is_never_made(backend: str) -> None:
    bad, good = fresh("bad"), fresh("good")
    got = deployed(fails_then_writes("x"), backend, [{"key": bad}, {"key": good}])
    assert got == [("LookupError", f"no entry for {bad!r}"), ("output", [good.upper(), 7])]
    assert not (STORE / bad).exists()  # the write after the failed check never ran


# -- a call's arguments are what they were when it was made ------------------------------------------


def extended(items: list[str]) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        busy = echo.hold(0.3)
        got = echo.echo(items)
        items += ["later"]
        return [got, items, busy]
    return pipeline


def merged(table: dict[str, int]) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        busy = echo.hold(0.3)
        got = echo.echo(table)
        table |= {"later": 1}
        return [got, sorted(table), busy]
    return pipeline


numbers = [1, 2]
with patchkit.capture(run=False, output="result") as multiplied:
    busy = echo.hold(0.3)
    got = echo.echo(numbers)
    numbers *= 2
    result = [got, numbers, busy]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_argument_changed_after_the_call_reaches_it_as_it_was(backend: str) -> None:
    cases = [(extended(["x"]), {"items": [fresh(), "b"]}), (merged({}), {"table": {fresh(): 2}}),
             (multiplied, {"numbers": [3, len(fresh())]})]
    for pipeline, inputs in cases:
        before = repr(next(iter(inputs.values())))
        eager = copy.deepcopy(inputs)  # the pipeline changes its inputs
        expected = outcome(lambda p=pipeline, i=eager: p(**i))
        assert expected[1][0] == before  # plain Python: the call gets the argument before it changes
        assert deployed(pipeline, backend, [inputs]) == [expected]


# -- no user code runs while calls are open ----------------------------------------------------------


def key_with_an_effect(items: list[int]) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        busy = echo.hold(0.3)
        got = echo.echo(items)
        order = sorted([2, 1], key=lambda v: items.append(v) or v)  # a key function with an effect
        biggest = max(["a", "bb"], key=lambda s: items.append(len(s)) or len(s))
        return [got, order, biggest, items, busy]
    return pipeline


class Loud:
    """A value with user dunders that have an effect: they note in `log` that they ran."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def __str__(self) -> str:
        self.log.append("str")
        return "loud"

    def __lt__(self, other: Any) -> bool:
        self.log.append("lt")
        return False


class Maker(Component):
    @make(read_only=True)
    def loud(self, tag: str) -> Loud:
        return Loud()


maker = Maker()


def dunders_with_an_effect(tag: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        loud = maker.loud(tag)
        busy = echo.hold(0.3)
        got = echo.echo(loud.log)
        text = str(loud) + f"{loud}" + tag
        less = loud < loud
        return [got, text, less, busy]
    return pipeline


def plain_work_keeps_the_window_open(items: list[int]) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        first = echo.span(0.3)
        total = sum(items) + len(items) + max(items)
        order = sorted(items, key=lambda v: -v)
        text = f"{total}: {order}" + str(items[0])
        second = other_echo.span(0.3)
        return [first, second, text]
    return pipeline


@pytest.mark.parametrize("backend", BACKENDS)
def test_user_code_never_runs_while_calls_are_open(backend: str) -> None:
    inputs = {"items": [len(fresh()), 5]}
    pipeline = key_with_an_effect([])
    expected = outcome(lambda: pipeline(**copy.deepcopy(inputs)))
    assert deployed(pipeline, backend, [inputs]) == [expected]
    assert expected[1][0] == repr(inputs["items"])  # the call saw the list before the key functions ran

    tag = fresh()
    with patchkit.deploy(dunders_with_an_effect("x"), backend=backend) as endpoint:
        got = endpoint.query(tag=tag)
    assert got == dunders_with_an_effect("x")(tag=tag) == ["[]", f"loudloud{tag}", False, 0.3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_work_between_calls_keeps_them_overlapping(backend: str) -> None:
    """The guards wait only where user code would run: sums, lengths, a sort by a key that reads, a format
    of numbers and lists do not, so the two calls around them are in flight together."""
    pipeline = plain_work_keeps_the_window_open([])
    labels = [[pipeline.graph.nodes[n].label for n in g] for g in pipeline.graph.overlap_groups]
    assert labels == [["echo.span", "other_echo.span"]]
    with patchkit.deploy(pipeline, backend=backend) as endpoint:
        (_, first_end), (second_start, _), text = endpoint.query(items=[3, 1, 2])
    assert text == "12: [3, 2, 1]3"
    assert second_start < first_end  # the second call started before the first ended


# -- errors: a component's TimeoutError is its own ---------------------------------------------------


def fetches(url: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        return fetcher.fetch(url)
    return pipeline


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_component_s_own_timeout_error_is_its_error_not_the_deadline(backend: str) -> None:
    url = f"http://example.invalid/{fresh()}"
    with patchkit.deploy(fetches("x"), backend=backend) as endpoint:
        with pytest.raises(patchkit.ComponentError, match=f"TimeoutError: reading {url} timed out") as caught:
            endpoint.query(url=url)
        assert not isinstance(caught.value, patchkit.DeadlineExceeded)
        outcomes = endpoint.stats()["requests"]
    assert outcomes.get("error") == 1 and "timeout" not in outcomes


# -- the output streams when a helper makes it --------------------------------------------------------


def respond(question: str) -> str:
    return streamer.generate(question)  # type: ignore[no-any-return]


question = "What is a generator?"
with patchkit.capture(run=False, output="answer") as streamed_by_a_helper:
    answer = respond(question)


def streamed_in_a_function(question: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        return respond(question)
    return pipeline


def streams(endpoint: patchkit.Endpoint, acks: Path) -> tuple[list[str], str]:
    """Stream one new question; the answer's last word says whether the first chunk arrived before it was done."""
    asked = fresh("q")
    stream = endpoint.stream(question=asked)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        (acks / asked).touch()
    assert stream.output == f"Answer to {asked} is read"
    return chunks, stream.output


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capture", ["module", "function"])
def test_an_output_made_inside_a_helper_streams(backend: str, capture: str) -> None:
    """In a module the front-end imports again (as this one), its helper reads the module's own `streamer`
    there: the call still goes to the deployed one, and streams."""
    pipeline = streamed_by_a_helper if capture == "module" else streamed_in_a_function("x")
    with patchkit.deploy(pipeline, backend=backend) as endpoint:
        chunks, output = streams(endpoint, ACKS)
    assert len(chunks) >= 2 and "".join(chunks) == output


SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import patchkit
    from components import Streamer
    from test_exact_overlap import streams

    acks = Path(sys.argv[1])
    llm = Streamer(ack_dir=str(acks))

    def respond(question):
        return llm.generate(question)

    question = "What is a generator?"
    with patchkit.capture(run=False, output="answer") as at_module_level:
        answer = respond(question)

    def in_a_function(question):
        with patchkit.capture(run=False) as pipeline:
            return respond(question)
        return pipeline

    counts = []
    for pipeline in (at_module_level, in_a_function("x")):
        with patchkit.deploy(pipeline) as endpoint:
            chunks, output = streams(endpoint, acks)
        counts.append(len(chunks) if "".join(chunks) == output else -1)
    print(json.dumps(counts))
    """
)


@pytest.mark.slow
def test_a_script_s_output_made_inside_a_helper_streams_from_the_default_backend(tmp_path: Path) -> None:
    """`python app.py` whose output comes from `respond(question)`, a helper of the script returning a streaming
    call's result, captured at module level and in a function: each streams chunk by chunk."""
    script, acks = tmp_path / "app.py", tmp_path / "acks"
    acks.mkdir()
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    done = subprocess.run([sys.executable, str(script), str(acks)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(counts) == 2 and all(n >= 2 for n in counts), counts


# -- the rewritten code leaves the user's module alone -----------------------------------------------


def test_parallel_programs_add_nothing_to_the_module_and_keep_no_code_alive() -> None:
    pipeline = extended(["x"])
    with patchkit.deploy(pipeline, backend="inprocess") as endpoint:
        endpoint.query(items=["y"])
    assert not [name for name in globals() if name.startswith("__patchkit")]
    clone = pickle.loads(cloudpickle.dumps(pipeline))  # a copy, with code objects of its own, as a front-end gets
    assert run_parallel(clone, {"items": ["z"]}) == pipeline(items=["z"])
    code = weakref.ref(clone._parallel.code)
    del clone
    gc.collect()
    assert code() is None  # its call sites and deferral marks went with it
