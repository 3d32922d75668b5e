"""The code rewritten for parallel calls runs as plain Python does, construct by construct.

Each snippet is captured, then run twice on new inputs (some of which make its components fail): as
plain Python, and as its parallel program under a hook that hands every deferred call back as a
`Pending` and runs it only when the code waits for it, so a Pending the code failed to wait for would
show in the output (or break it), and a call run out of its place would change the error raised.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import load_source
from test_parallel_calls import outcome

import patchkit
from patchkit.capture.pending import Window, run_in_window
from patchkit.core import call_hook

SNIPPETS = {
    "independent_then_merge": '''
def run(query):
    with patchkit.capture():
        a = retriever.retrieve(query)
        b = llm.generate(query)
        c = grader.score(query)
        return [a, b, c]
''',
    "local_work_between_calls": '''
def run(query):
    with patchkit.capture():
        a = llm.generate(query)
        prompt = f"Rewrite: {query!r} " + query.upper()[:3] * 2
        b = llm2.generate(prompt, max_words=len(prompt) % 5 + 1)
        n = int(len(query) > 3) + 2
        return {"a": a, "b": b, "n": n, "both": a + " / " + b}
''',
    "conditional_call_and_unbound_path": '''
def run(query):
    with patchkit.capture():
        if "generator" in query:
            extra = llm.generate(query)
        first = grader.score(query)
        return [first, extra]
''',
    "overwritten_before_use": '''
def run(query):
    with patchkit.capture():
        x = llm.generate(query)
        x = "plain " + query
        y = llm2.generate(query + " boom" if "nothing" in query else query)
        return [x, y]
''',
    "loop_with_break_and_continue": '''
def run(query):
    with patchkit.capture():
        out = []
        for word in query.split():
            if len(word) < 3:
                continue
            s = grader.score(word)
            if s == 6:
                break
            out = out + [s]
        return out
''',
    "while_on_a_result": '''
def run(query):
    with patchkit.capture():
        text, hops = query, 0
        while hops < 3:
            text = llm.generate(text, max_words=3 + hops)
            hops += 1
            if grader.score(text) > 5:
                break
        return text, hops
''',
    "nested_comprehensions": '''
def run(query):
    with patchkit.capture():
        words = query.split()
        table = [[grader.score(w + c) for c in "ab"] for w in words]
        flat = [llm.generate(w, max_words=2) for w in words if w]
        return table, flat
''',
    "dict_set_and_generator": '''
def run(query):
    with patchkit.capture():
        scores = {w: grader.score(w) for w in query.split()}
        kinds = {grader.score(w) % 2 for w in query.split()}
        joined = " | ".join(llm.generate(w, max_words=1) for w in query.split()[:2])
        return scores, sorted(kinds), joined
''',
    "lambda_reads_a_result": '''
def run(query):
    with patchkit.capture():
        docs = retriever.retrieve(query)
        count = lambda: len(docs)
        other = llm.generate(query)
        return count(), other
''',
    "walrus_augmented_and_del": '''
def run(query):
    with patchkit.capture():
        total = grader.score(query)
        total += grader.score(query[::-1])
        if (s := grader.score(query[:4])) > 2:
            total += s
        tmp = llm.generate(query)
        del tmp
        return total
''',
    "builtins_and_containers_over_results": '''
def run(query):
    with patchkit.capture():
        a = grader.score(query)
        b = grader.score(query[::-1])
        words = query.split()
        ranked = sorted(words, key=lambda w: (-len(w), w), reverse=True)
        table = {"a": a, "b": b, **{w: len(w) for w in words[:2]}}
        kinds = {a % 2, b % 2} | set(words[:1])
        first, *rest = [a, b, max(a, b, key=lambda v: -v)]
        found = "generator" in query and a in (1, 2, 3)
        label = f"{a:>3}|{b!r}|{query[1:4]}|{len(rest)}"
        c = llm.generate(label)
        return ranked, sorted(table.items()), sorted(kinds, key=str), first, rest, found, c
''',
    "changes_after_calls": '''
def run(query):
    with patchkit.capture():
        words = query.split()
        counts = {"n": 1}
        a = llm.generate(query, max_words=len(words))
        b = grader.score(query)
        words += ["later"]
        counts |= {"m": 2}
        text = query
        text += "!"
        n = b
        n *= 2
        c = llm2.generate(text, max_words=n % 4 + 1)
        words *= 2
        return a, c, words, sorted(counts), n
''',
    "user_code_between_calls": '''
seen = []

class Tag:
    def __init__(self, text):
        self.text = text
    def __str__(self):
        seen.append(self.text)
        return "<" + self.text + ">"
    @property
    def size(self):
        seen.append("size")
        return len(self.text)

def steps(text):
    for w in text.split():
        seen.append(w)
        yield w

def run(query):
    tag = Tag(query[:5])
    with patchkit.capture():
        del seen[:]
        a = llm.generate(query)
        b = grader.score(query)
        shown = str(tag) + f"{tag}" + str(tag.size)
        picked = sorted(query.split(), key=lambda w: seen.append(w) or len(w))
        total = sum(len(w) for w in steps(query))
        c = llm2.generate(shown, max_words=total % 5 + 1)
        return a, b, c, picked, list(seen)
''',
    "try_except_around_calls": '''
def run(query):
    with patchkit.capture():
        before = llm.generate(query)
        try:
            checked = flaky.check(query)
            after = llm2.generate(checked)
        except ValueError as error:
            checked, after = "failed", str(error)[:20]
        finally:
            tail = grader.score(query)
        return before, checked, after, tail
''',
    "with_statement_and_match": '''
import contextlib
def run(query):
    with patchkit.capture():
        a = llm.generate(query)
        with contextlib.suppress(KeyError):
            b = llm2.generate(a)
        match len(query.split()):
            case 1:
                c = "one"
            case _:
                c = grader.score(query)
        return a, b, c
''',
    "early_return_inside_loop": '''
def run(query):
    with patchkit.capture():
        seen = []
        for word in query.split():
            doc = retriever.lookup(word.lower())
            seen = seen + [doc["title"]]
            if doc["text"]:
                return doc["text"], seen
        return None, seen
''',
    "identity_and_types": '''
import json
def run(query):
    with patchkit.capture():
        a = retriever.retrieve(query)
        b = retriever.retrieve(query)
        facts = [a is b, a == b, isinstance(a, list), type(b).__name__]
        return json.dumps([a, b, facts])
''',
    "errors_in_order": '''
def run(query):
    with patchkit.capture():
        first = flaky.check(query)
        second = llm.generate(query + " boom")
        third = int(query) if query.isdigit() else len(query) // 0
        return first, second, third
''',
    "output_of_a_helper_call": '''
def shout(text):
    return text.upper() + "!"
def run(query):
    with patchkit.capture():
        a = llm.generate(query)
        b = llm2.generate(query)
        return shout(a), shout(b)
''',
    "generator_loop_with_effects": '''
log = []
def words(text):
    for w in text.split():
        log.append(w)
        yield w
def run(query):
    with patchkit.capture():
        log.clear()
        scores = [grader.score(w) for w in words(query)]
        return scores, list(log)
''',
    "last_of_a_loop_and_discarded_calls": '''
def run(query):
    with patchkit.capture():
        last = None
        for word in query.split():
            last = grader.score(word)
            grader.score(word + "!")
        return last
''',
    "comprehension_reads_an_open_result": '''
def run(query):
    with patchkit.capture():
        top = grader.score(query)
        words = query.split()
        kept = [w for w in words if grader.score(w) != top]
        picked = llm.generate(query) if kept else llm2.generate(query)
        return top, kept, picked
''',
    "branches_use_results_of_each_other": '''
def run(query):
    with patchkit.capture():
        a = grader.score(query)
        b = llm.generate(query)
        if len(query) % 2:
            out = b + str(a)
        else:
            c = llm2.generate(b)
            out = c * (a % 3)
        assert out is not None, "no output"
        return out
''',
    "results_iterated_and_unpacked": '''
def run(query):
    with patchkit.capture():
        docs = retriever.retrieve(query)
        more = retriever.retrieve(query[::-1])
        first, *rest = docs + more + ["pad", "pad"]
        lengths = [len(d) for d in docs]
        return first, len(rest), lengths
''',
    "loop_in_a_try_after_a_call_on_one_path": '''
def run(query):
    with patchkit.capture():
        if "generator" in query:
            maybe = llm.generate(query)
        other = grader.score(query)
        try:
            total = 0
            for word in query.split():
                total += len(word)
        except ValueError:
            total = -1
        return other, total, maybe
''',
}

MODULE_SNIPPETS = {
    "module_independent": '''
with patchkit.capture(output="answer"):
    a = llm.generate(query)
    b = llm2.generate(query[::-1])
    parts = [grader.score(w) for w in query.split()]
    answer = [a, b, parts]
''',
    "module_output_pending_at_exit": '''
with patchkit.capture(output="answer"):
    note = grader.score(query)
    answer = llm.generate(query)
''',
    "module_helper_reads_results": '''
with patchkit.capture(output="answer"):
    a = llm.generate(query)
    b = grader.score(query)
    def describe():
        return f"{a} ({b})"
    answer = describe()
''',
}

QUERIES = ["How do I catch an exception?", "What is a generator?", "Tell me about nothing", "boom", "fail now",
           "What is boom?", "a b", "12"]


def run_parallel(pipeline: patchkit.Pipeline, inputs: dict[str, Any]) -> Any:
    """The parallel program, each deferred call run only when the code waits for it (as the runner does,
    with the calls' futures replaced by running them there)."""
    window = Window()

    def hook(component: Any, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any], site: Any) -> Any:
        def wait() -> Any:
            return method.run_local(component, args, kwargs)

        return window.add(wait, lambda: None) if site is not None and site.deferred else wait()

    with call_hook(hook):
        return run_in_window(window, lambda: pipeline.run(pipeline.variables(inputs), parallel=True))


def captured(source: str, module: bool) -> patchkit.Pipeline:
    if module:
        load_source(source, "<snippet>", extra={"query": QUERIES[0]})
    else:
        namespace = load_source(source, "<snippet>")
        try:
            namespace["run"](QUERIES[0])
        except Exception:
            pass
    return patchkit.last_pipeline()


@pytest.mark.parametrize(("name", "module"), [(n, False) for n in SNIPPETS] + [(n, True) for n in MODULE_SNIPPETS])
def test_the_parallel_program_runs_as_plain_python(name: str, module: bool) -> None:
    source = (MODULE_SNIPPETS if module else SNIPPETS)[name]
    pipeline = captured(source, module)
    for query in QUERIES:
        expected = outcome(lambda q=query: pipeline(query=q))
        assert outcome(lambda q=query: run_parallel(pipeline, {"query": q})) == expected, query


def test_the_snippets_overlap_calls() -> None:
    """The snippets are not vacuous: many of them do defer calls."""
    overlapping = [name for name, source in SNIPPETS.items() if captured(source, False).graph.overlap_groups]
    assert len(overlapping) >= 7, overlapping
