"""Calls in flight see their arguments as they were, and no user code runs before them.

A call's closure (a lambda, a nested function, a generator expression) reads its variables when the
component runs it, so a later store to one of them (a cell, a `nonlocal`, a `global`, a module-level name)
waits for the calls in flight. A class attribute's descriptor, a module's `__getattr__` and a proxy's
`__getattr__` are user code: they run after the calls before them, as in plain Python, and the guards
that decide it never run them themselves. Each pipeline is compared with the same code run as plain Python
(`pipeline(...)`), on its output and on the order of the effects it notes: the components' and the user
code's, in one log file per pipeline, across the front-end's and the workers' processes.
"""

from __future__ import annotations

import dis
import importlib.util
import os
import shutil
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

import patchkit
from patchkit import Component, make
from patchkit.capture import guards
from patchkit.capture.guards import CHECKS, INPLACE_OPS, SHALLOW_OPS

# The front-end and the workers import this module again: the log directory reaches them by the environment.
EVENTS = Path(os.environ.setdefault("OVERLAP_TEST_EVENTS", tempfile.mkdtemp(prefix="patchkit-overlap-events-")))


BENCHMARK = Path(__file__).parent.parent / "benchmarks" / "overlap_guards.py"


@pytest.fixture(scope="module", autouse=True)
def _remove_events() -> Iterator[None]:
    yield
    shutil.rmtree(EVENTS, ignore_errors=True)


def note(log: str, event: str) -> None:
    with (EVENTS / log).open("a") as f:
        f.write(event + "\n")


def events(log: str) -> list[str]:
    path = EVENTS / log
    return path.read_text().splitlines() if path.exists() else []


class Scorer(Component):
    """Scores documents with the function it is handed, after a pause; notes when it ran."""

    def __init__(self, pause_s: float = 0.3) -> None:
        self.pause_s = pause_s

    @make(read_only=True)
    def hold(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @make(read_only=True)
    def score(self, log: str, docs: list[int], weigh: Callable[[int], int]) -> list[int]:
        time.sleep(self.pause_s)
        out = [weigh(d) for d in docs]
        note(log, f"score {out}")
        return out

    @make(read_only=True)
    def total(self, log: str, values: Iterable[int]) -> int:
        time.sleep(self.pause_s)
        out = sum(values)
        note(log, f"total {out}")
        return out

    @make(read_only=True)
    def tag(self, log: str, text: str) -> str:
        time.sleep(self.pause_s)
        note(log, f"tag {text}")
        return text.upper()


scorer = Scorer()


# -- closures handed to a call read their variables as they were -------------------------------------------


def lambda_then_store(log: str, docs: list[int]) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        weight = 2
        busy = scorer.hold(0.2)
        scored = scorer.score(log, docs, lambda d: d * weight)
        weight = 100
        return [scored, weight, busy]
    return pipeline


def nested_def_then_store(log: str, docs: list[int]) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        weight = 3

        def weigh(d: int) -> int:
            note(log, f"weigh {d} by {weight}")
            return d * weight

        busy = scorer.hold(0.2)
        scored = scorer.score(log, docs, weigh)
        weight = 100
        note(log, f"after, weight {weight}")
        return [scored, weight, busy]
    return pipeline


def loop_of_lambdas(log: str, docs: list[int]) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        # Late binding on purpose: plain Python makes each call before `w` moves on, so each sees its own.
        scored = [scorer.score(log, docs, lambda d: d * w) for w in (2, 3)]  # noqa: B023
        return scored
    return pipeline


def generator_then_store(log: str, docs: list[int]) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        weight = 4
        values = (d * weight for d in docs)  # made before any call is in flight, iterated by the component
        busy = scorer.hold(0.2)
        summed = scorer.total(log, values)
        weight = 100
        return [summed, weight, busy]
    return pipeline


def nonlocal_then_store() -> patchkit.Pipeline:
    weight = 5

    def build(log: str, docs: list[int]) -> patchkit.Pipeline:
        nonlocal weight
        with patchkit.capture(run=False) as pipeline:
            busy = scorer.hold(0.2)
            scored = scorer.score(log, docs, lambda d: d * weight)
            weight += 95
            return [scored, weight, busy]
        return pipeline

    return build("x", [1])


WEIGHT = 6


def global_then_store(log: str, docs: list[int]) -> patchkit.Pipeline:
    global WEIGHT
    with patchkit.capture(run=False) as pipeline:
        WEIGHT = 6
        busy = scorer.hold(0.2)
        scored = scorer.score(log, docs, lambda d: d * WEIGHT)
        WEIGHT = 100
        return [scored, WEIGHT, busy]
    return pipeline


log, docs, weight = "x", [1], 7
with patchkit.capture(run=False, output="scored_at_module") as module_name_then_store:  # as scripts write it
    busy = scorer.hold(0.2)
    scored = scorer.score(log, docs, lambda d: d * weight)
    weight = 100
    scored_at_module = [scored, weight, busy]


# -- user code: a class attribute's descriptor, a module's `__getattr__`, a proxy ---------------------------


class Scaled:
    """A descriptor (not a data one) that notes each read."""

    def __get__(self, obj: Any, owner: type | None = None) -> int:
        note("descriptor", "get scale")
        return 3


class Settings:
    scale = Scaled()


def reads_a_class_descriptor(text: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        busy = scorer.hold(0.2)
        tagged = scorer.tag("descriptor", text)
        factor = Settings.scale
        return [tagged, factor, busy]
    return pipeline


def _load_lazily(name: str) -> int:
    note("module", f"load {name}")
    return len(name)


lazy = types.ModuleType("lazy_settings")  # a module whose names come from its `__getattr__` (PEP 562)
lazy.__getattr__ = _load_lazily  # type: ignore[method-assign]


class LazyModule(types.ModuleType):
    """A lazy module as loaders make them: a ModuleType whose class loads what is missing."""

    def __getattr__(self, name: str) -> int:
        note("module", f"lazy load {name}")
        return len(name) * 2


lazier = LazyModule("lazier_settings")


def reads_lazy_modules(text: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        busy = scorer.hold(0.2)
        tagged = scorer.tag("module", text)
        size = lazy.threshold
        bigger = lazier.threshold
        return [tagged, size, bigger, busy]
    return pipeline


class Proxy:
    """A delegating proxy with slots: what it does not have it fetches from its target, noting it."""

    __slots__ = ("_log", "_target")

    def __init__(self, target: Any, log: str) -> None:
        self._target, self._log = target, log

    def __getattr__(self, name: str) -> Any:
        note(self._log, f"getattr {name}")
        return getattr(self._target, name)


def reads_through_a_proxy(text: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        proxy = Proxy(text, "proxy")
        busy = scorer.hold(0.2)
        tagged = scorer.tag("proxy", text)
        shout = proxy.upper
        return [tagged, shout(), busy]
    return pipeline


class Noted:
    """A number that notes each addition to it."""

    def __init__(self, n: int, log: str) -> None:
        self.n, self.log = n, log

    def __add__(self, other: int) -> int:
        note(self.log, "add")
        return self.n + other


def sometimes_an_object(text: str) -> patchkit.Pipeline:
    """`n` is a plain number on one path and an object with an `__add__` on the other: the `+=` after the
    calls waits for them unless `n` is a number on every path."""
    with patchkit.capture(run=False) as pipeline:
        n = 1
        if len(text) > 3:
            n = Noted(len(text), "scalar")
        busy = scorer.hold(0.2)
        tagged = scorer.tag("scalar", text)
        n += 1
        return [tagged, n, busy]
    return pipeline


CASES: dict[str, tuple[Callable[[], patchkit.Pipeline], dict[str, Any]]] = {
    "lambda": (lambda: lambda_then_store("x", [1]), {"log": "lambda", "docs": [4, 9]}),
    "nested_def": (lambda: nested_def_then_store("x", [1]), {"log": "nested_def", "docs": [2, 8]}),
    "loop_of_lambdas": (lambda: loop_of_lambdas("x", [1]), {"log": "loop_of_lambdas", "docs": [5]}),
    "nonlocal": (nonlocal_then_store, {"log": "nonlocal", "docs": [3, 1], "weight": 5}),
    "global": (lambda: global_then_store("x", [1]), {"log": "global", "docs": [7]}),
    "module_name": (lambda: module_name_then_store, {"log": "module_name", "docs": [6, 2], "weight": 7}),
    "generator": (lambda: generator_then_store("x", [1]), {"log": "generator", "docs": [1, 2, 3]}),
    "descriptor": (lambda: reads_a_class_descriptor("x"), {"text": "settings"}),
    "module": (lambda: reads_lazy_modules("x"), {"text": "lazy"}),
    "proxy": (lambda: reads_through_a_proxy("x"), {"text": "proxied"}),
    "scalar": (lambda: sometimes_an_object("x"), {"text": "object"}),
}
LOCAL = ["lambda", "nested_def", "nonlocal", "module_name", "descriptor", "proxy"]  # what pickles to a worker


def _log_of(name: str, inputs: dict[str, Any]) -> str:
    return str(inputs.get("log", name))


def _expected(names: Iterable[str]) -> dict[str, tuple[Any, list[str]]]:
    """Each case as plain Python runs it: its output and the effects it noted, in order."""
    out = {}
    for name in names:
        build, inputs = CASES[name]
        log = _log_of(name, inputs)
        (EVENTS / log).unlink(missing_ok=True)
        output = build()(**inputs)
        out[name] = (output, events(log))
    return out


def _deployed(names: list[str], backend: str) -> dict[str, tuple[Any, list[str]]]:
    pipelines = {name: CASES[name][0]() for name in names}
    out = {}
    with patchkit.deploy(pipelines, backend=backend) as endpoint:
        for name in names:
            inputs = CASES[name][1]
            log = _log_of(name, inputs)
            (EVENTS / log).unlink(missing_ok=True)
            output = endpoint[name].query(**inputs)
            out[name] = (output, events(log))
    return out


def _json(value: Any) -> Any:
    """A plain output as it comes back over HTTP (tuples as lists)."""
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    return value


@pytest.fixture(scope="module")
def plain() -> Iterator[dict[str, tuple[Any, list[str]]]]:
    yield _expected(CASES)


def test_the_plain_runs_see_the_values_before_the_stores(plain: dict[str, tuple[Any, list[str]]]) -> None:
    """The reference itself: what each call saw, and where the user code ran."""
    assert plain["lambda"][0] == [[8, 18], 100, 0.2]
    assert plain["nested_def"] == ([[6, 24], 100, 0.2], ["weigh 2 by 3", "weigh 8 by 3", "score [6, 24]",
                                                         "after, weight 100"])
    assert plain["loop_of_lambdas"][0] == [[10], [15]]
    assert plain["nonlocal"][0] == [[15, 5], 100, 0.2]
    assert plain["module_name"][0] == [[42, 14], 100, 0.2]
    assert plain["generator"][0] == [24, 100, 0.2]
    assert plain["descriptor"] == (["SETTINGS", 3, 0.2], ["tag settings", "get scale"])
    assert plain["module"] == (["LAZY", 9, 18, 0.2], ["tag lazy", "load threshold", "lazy load threshold"])
    assert plain["proxy"] == (["PROXIED", "PROXIED", 0.2], ["tag proxied", "getattr upper"])
    assert plain["scalar"] == (["OBJECT", 7, 0.2], ["tag object", "add"])


def test_the_cases_overlap_their_calls() -> None:
    """Not vacuous: each pipeline has calls in flight together when the store or the user code comes; a
    loop that stores the variable its lambdas read waits for each call before the next store."""
    for name, (build, _) in CASES.items():
        assert bool(build().graph.overlap_groups) == (name != "loop_of_lambdas"), name


def test_inprocess_runs_as_plain_python(plain: dict[str, tuple[Any, list[str]]]) -> None:
    got = _deployed(list(CASES), "inprocess")
    differ = {name: got[name] for name in CASES if got[name] != (_json(plain[name][0]), plain[name][1])}
    assert differ == {}


@pytest.mark.slow
def test_the_default_backend_runs_as_plain_python(plain: dict[str, tuple[Any, list[str]]]) -> None:
    got = _deployed(LOCAL, "local")
    differ = {name: got[name] for name in LOCAL if got[name] != (_json(plain[name][0]), plain[name][1])}
    assert differ == {}


# -- the guards read types, never the user's objects --------------------------------------------------------


class Counting:
    """Counts every attribute it is asked for that it lacks, and every read of its one property."""

    __slots__ = ("asked",)

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.asked.append(name)
        return name

    @property
    def shown(self) -> str:
        self.asked.append("shown")
        return "shown"


class Meta(type):
    def __getattr__(cls, name: str) -> Any:
        raise AssertionError(f"the metaclass was asked for {name}")


class WithMeta(metaclass=Meta):
    plain = 1


class Keyed:
    def __init__(self) -> None:
        self.hashed = 0

    def __hash__(self) -> int:
        self.hashed += 1
        return 1


def test_the_attribute_check_runs_no_user_code() -> None:
    check = CHECKS["attribute"]
    proxy = Counting()
    assert not check({}, proxy, "missing")  # `__getattr__` would run: the calls are settled first
    assert not check({}, proxy, "shown")  # a property
    assert check({}, proxy, "asked")  # a slot that is set
    assert not check({}, WithMeta, "other")  # the metaclass's `__getattr__` would run
    assert not check({}, Settings, "scale")  # a descriptor of the class
    assert check({}, types, "ModuleType") and not check({}, lazy, "threshold") and not check({}, lazier, "x")
    assert proxy.asked == []  # the checks themselves asked nothing


class Hashing(type):
    """A metaclass whose classes note when they are hashed or compared: a check that tested `type(x)` in a
    set of types would run them."""

    seen: list[str] = []

    def __hash__(cls) -> int:
        Hashing.seen.append("hash")
        return 1

    def __eq__(cls, other: object) -> bool:
        Hashing.seen.append("eq")
        return False


class Odd(metaclass=Hashing):
    pass


def test_the_checks_never_hash_or_compare_a_type_of_the_user_s() -> None:
    odd = Odd()
    assert not CHECKS["deep"]({}, odd, 1) and not CHECKS["shallow"]({}, odd)
    assert not CHECKS["call"]({}, sorted, [odd]) and not CHECKS["call"]({}, len, odd)
    assert not CHECKS["subscript"]({}, {}, odd) and not CHECKS["deep"]({}, [odd] * 20)
    assert CHECKS["attribute"]({}, odd, "missing")  # plain Python raises AttributeError, running nothing
    assert Hashing.seen == []


def test_a_lookup_with_a_key_of_the_user_s_settles() -> None:
    key = Keyed()
    assert not CHECKS["subscript"]({}, {1: 2}, key) and not CHECKS["deep"]({}, key, [1, 2])
    assert key.hashed == 0


def test_a_long_container_is_walked_once_between_two_waits() -> None:
    """A check's cost does not grow with the container once it is known: its verdict is kept by identity."""
    memo: dict[int, Any] = {}
    big = list(range(5000))
    assert CHECKS["deep"](memo, 3, big)
    assert memo[id(big)] == (big, 5000, True)
    big.append(Keyed())  # a change the request's own code could only make after settling
    assert not CHECKS["deep"](memo, 3, big)
    assert not CHECKS["deep"]({}, 3, list(range(20_000)))  # too long to walk: the calls are settled first


def _binary_op_of(source: str, mode: str) -> int:
    [op] = [i.arg for i in dis.get_instructions(compile(source, "<operator>", mode)) if i.opname == "BINARY_OP"]
    assert op is not None
    return op


@pytest.mark.parametrize("symbol", ["+", "&", "//", "<<", "@", "*", "%", "|", "**", ">>", "-", "/", "^"])
def test_the_operator_sets_are_what_this_python_compiles_each_operator_to(symbol: str) -> None:
    """The guards know an operator by the number BINARY_OP carries for it on the running Python: arithmetic,
    concatenation and repetition look at no item; `x op= y` is known as in place, with its plain operator."""
    plain, in_place = _binary_op_of(f"x {symbol} y", "eval"), _binary_op_of(f"x {symbol}= y", "exec")
    assert (plain in SHALLOW_OPS) == (symbol in {"+", "//", "<<", "@", "*", "**", ">>", "/"})
    assert plain not in INPLACE_OPS and in_place in INPLACE_OPS
    assert CHECKS["inplace"]({}, "text", [Keyed()], in_place) == (plain in SHALLOW_OPS)  # the others walk the items


def test_an_operator_this_python_does_not_name_is_an_import_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dis, "_nb_ops", [entry for entry in dis._nb_ops if entry[0] != "NB_INPLACE_XOR"])
    spec = importlib.util.spec_from_file_location("guards_elsewhere", guards.__file__)
    assert spec is not None and spec.loader is not None
    with pytest.raises(ImportError, match=r"NB_INPLACE_XOR, and Python 3\.\d+\.\d+ does not have it"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_the_membership_benchmark_keeps_its_calls_open_through_the_loop() -> None:
    """benchmarks/overlap_guards.py measures what it says: the same output both ways, and both calls still
    in flight when the loop is done (its `x in big` checks settled nothing)."""
    spec = importlib.util.spec_from_file_location("overlap_guards", BENCHMARK)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.measure(300, 1)
    assert result["calls_open_through_loop"] == 2
