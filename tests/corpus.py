"""The capture corpus: pipelines written as users write them, each with inputs to re-run it on.

Each case is source code using the components of `tests/components.py` (bound as `retriever`,
`grader`, `llm`, `llm2`, `flaky`). A "function" case defines `run(...)` whose body holds the capture
block; a "module" case is module-level code whose block ends by assigning `output` (or the name the
case gives). The tests compare the captured pipeline, re-run on each input, with plain Python.

`FIDELITY` holds the cases of issue 18, as users write them: a capture inside another statement
(an outer `with`, a second `with` item, `try/finally`), components reached through `self`, a
captured pipeline called from another, `super()`, components in containers on a path the capture
run does not take, and a block that returns on one path and ends on another. They are part of
`CASES`; `tests/test_capture_fidelity.py` checks what each class adds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

QUERIES = [
    {"query": "How do I catch an exception?"},
    {"query": "What is a generator?"},
    {"query": "Tell me about nothing in particular"},
]


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "function" | "module"
    source: str
    inputs: list[dict[str, Any]] = field(default_factory=lambda: QUERIES)
    output: str | None = None  # module cases: the variable holding the result
    calls: frozenset[str] = frozenset()  # component.method names the static graph must find
    components: frozenset[str] = frozenset()  # names `pipeline.components` must hold, called or not
    exact_inputs: bool = False  # the pipeline's inputs are exactly the names the case passes


CASES = [
    Case("crag_figure9", "function", '''
def run(query):
    with patchkit.capture():
        retrieved = retriever.retrieve(query)
        relevant = grader.grade(query, retrieved)
        if not relevant:
            better = llm.generate("Add more context: " + query)
            docs = retriever.retrieve(better)
            return llm.generate(better, docs)
        else:
            return llm.generate(query, retrieved)
''', calls=frozenset({"retriever.retrieve", "grader.grade", "llm.generate"})),
    Case("if_elif_else", "function", '''
def run(query):
    with patchkit.capture():
        s = grader.score(query)
        if s < 2:
            out = llm.generate("low " + query)
        elif s < 5:
            out = llm2.generate("mid " + query)
        else:
            out = "high:" + query
    return out
''', calls=frozenset({"grader.score", "llm.generate", "llm2.generate"})),
    Case("for_over_docs", "function", '''
def run(query):
    with patchkit.capture():
        scores = []
        for doc in retriever.retrieve(query):
            scores.append(grader.score(doc))
        return scores
''', calls=frozenset({"retriever.retrieve", "grader.score"})),
    Case("while_count_from_result", "function", '''
def run(query):
    with patchkit.capture():
        hops = 0
        docs = retriever.retrieve(query)
        while not grader.grade(query, docs) and hops < 3:
            query = llm.rewrite(query)
            docs = retriever.retrieve(query)
            hops += 1
        return hops, docs
'''),
    Case("break_continue", "function", '''
def run(query):
    with patchkit.capture():
        kept = []
        for word in query.split():
            if len(word) < 3:
                continue
            kept.append(llm.generate(word, max_words=1))
            if grader.score(word) == 0:
                break
        return kept
'''),
    Case("try_except", "function", '''
def run(query):
    with patchkit.capture():
        try:
            checked = flaky.check(query if "?" in query else "fail " + query)
        except ValueError as err:
            checked = llm.generate("recover " + str(err)[:20])
        return checked
''', calls=frozenset({"flaky.check", "llm.generate"})),
    Case("list_comprehension", "function", '''
def run(query):
    with patchkit.capture():
        parts = [retriever.retrieve(w) for w in query.split() if len(w) > 3]
        return [len(p) for p in parts]
''', calls=frozenset({"retriever.retrieve"})),
    Case("generator_expression", "function", '''
def run(query):
    with patchkit.capture():
        return " | ".join(llm.generate(w, max_words=2) for w in query.split()[:3])
''', calls=frozenset({"llm.generate"})),
    Case("dict_and_set_comprehension", "function", '''
def run(query):
    with patchkit.capture():
        by_word = {w: grader.score(w) for w in query.split()}
        distinct = {grader.score(w) % 3 for w in query.split()}
        return by_word, sorted(distinct)
'''),
    Case("fstring_prompts", "function", '''
def run(query):
    with patchkit.capture():
        docs = retriever.retrieve(query.strip().lower())
        prompt = f"Question: {query.upper()!r}\\nContext: {'; '.join(d[:12] for d in docs)}"
        return llm.generate(prompt.replace("?", ""), max_words=8)
'''),
    Case("walrus", "function", '''
def run(query):
    with patchkit.capture():
        if (docs := retriever.retrieve(query)):
            answer = llm.generate(query, docs)
        else:
            answer = "no documents"
        return answer
'''),
    Case("match_statement", "function", '''
def run(query):
    with patchkit.capture():
        match grader.score(query):
            case 0 | 1:
                out = llm.generate("small")
            case 2 | 3 | 4:
                out = llm2.generate("medium")
            case _:
                out = "large"
        return out
'''),
    Case("keyword_arguments", "function", '''
def run(query):
    with patchkit.capture():
        docs = retriever.retrieve(query=query)
        return llm.generate(prompt=query, docs=docs, max_words=3)
'''),
    Case("subscript_dict_result", "function", '''
def run(query):
    with patchkit.capture():
        key = "exceptions" if "exception" in query else "generators"
        record = retriever.lookup(key)
        return llm.generate(record["title"], [record["text"]])
''', calls=frozenset({"retriever.lookup", "llm.generate"})),
    Case("two_instances_one_class", "function", '''
def run(query):
    with patchkit.capture():
        first = llm.generate(query, max_words=2)
        second = llm2.generate(first, max_words=3)
        return first, second
''', calls=frozenset({"llm.generate", "llm2.generate"})),
    Case("module_globals_and_constants", "function", '''
MAX_WORDS = 4
PREFIX = "Answer briefly: "
def run(query):
    with patchkit.capture():
        docs = retriever.retrieve(query)[:MAX_WORDS]
        return llm.generate(PREFIX + query, docs, max_words=MAX_WORDS)
'''),
    Case("helper_calls_component", "function", '''
def rewrite_and_retrieve(q):
    better = llm.generate("Rewrite: " + q, max_words=4)
    return retriever.retrieve(better)
def run(query):
    with patchkit.capture():
        docs = rewrite_and_retrieve(query)
        return llm2.generate(query, docs)
''', calls=frozenset({"llm.generate", "retriever.retrieve", "llm2.generate"})),
    Case("nested_helpers", "function", '''
def grade_docs(q, docs):
    return [d for d in docs if grader.score(d) > 1]
def answer(q):
    docs = grade_docs(q, retriever.retrieve(q))
    return llm.generate(q, docs)
def run(query):
    with patchkit.capture():
        return answer(query)
''', calls=frozenset({"grader.score", "retriever.retrieve", "llm.generate"})),
    Case("local_closure_helper", "function", '''
def run(query):
    words = 3
    def summarise(text):
        return llm.generate(text, max_words=words)
    with patchkit.capture():
        return summarise(query) + " / " + summarise(query[::-1])
''', calls=frozenset({"llm.generate"})),
    Case("lambda_and_map", "function", '''
def run(query):
    with patchkit.capture():
        shout = lambda w: llm.generate(w.upper(), max_words=1)
        return list(map(shout, query.split()[:2]))
''', calls=frozenset({"llm.generate"})),
    Case("early_return_in_loop", "function", '''
def run(query):
    with patchkit.capture():
        for attempt in range(3):
            docs = retriever.retrieve(query)
            if grader.grade(query, docs):
                return attempt, llm.generate(query, docs)
            query = llm.rewrite(query)
        return None
'''),
    Case("ircot_loop", "function", '''
def run(query):
    with patchkit.capture():
        context = []
        thought = query
        for hop in range(3):
            context += retriever.retrieve(thought)
            thought = llm.generate(thought, context, max_words=4 + hop)
            if grader.score(thought) == 3:
                break
        return thought, len(context)
'''),
    Case("closure_in_comprehension", "function", '''
def run(query, limit=2):
    with patchkit.capture():
        return [llm.generate(w, max_words=limit) for w in query.split() if grader.score(w) >= limit]
'''),
    Case("del_and_augmented", "function", '''
def run(query):
    with patchkit.capture():
        total = grader.score(query)
        total += grader.score(query[::-1])
        scratch = llm.generate(query)
        total *= len(scratch)
        del scratch
        return total
'''),
    Case("batch_method_with_keyword", "function", '''
def run(query):
    with patchkit.capture():
        return llm.rewrite(query=query)
'''),
    Case("module_default_output", "module", '''
docs = retriever.retrieve(query)
with patchkit.capture():
    docs = retriever.retrieve(query)
    answer = llm.generate(query, docs)
''', output="answer"),
    Case("module_named_output", "module", '''
with patchkit.capture(output="answer"):
    answer = llm.generate(query)
    if grader.score(query) > 3:
        answer = llm2.generate(answer)
    trace = [answer]
''', output="answer"),
    Case("module_comprehension_reads_input", "module", '''
with patchkit.capture():
    scored = [grader.score(w + query[:3]) for w in query.split()]
    answer = sum(scored)
''', output="answer"),
    Case("module_loop_and_branch", "module", '''
with patchkit.capture():
    notes = []
    for doc in retriever.retrieve(query):
        if grader.score(doc) % 2:
            notes.append(llm.generate(doc, max_words=2))
        else:
            notes.append(doc[:5])
    answer = notes
''', output="answer"),
]


# Issue 18: each input list's first entry is the capture run; the later ones take other paths.
FIDELITY = [
    # 1. a capture inside another statement of the same function or script
    Case("capture_inside_tracing_span", "function", '''
class span:
    """A tracing span, as OpenTelemetry's start_as_current_span, or torch.no_grad()."""
    opened = []
    def __init__(self, name):
        self.name = name
    def __enter__(self):
        span.opened.append(self.name)
        return self
    def __exit__(self, *exc):
        return False
def run(query):
    with span("rag"):
        with patchkit.capture():
            docs = retriever.retrieve(query)
            answer = llm.generate(query, docs)
    return answer
''', calls=frozenset({"retriever.retrieve", "llm.generate"})),
    Case("capture_as_second_with_item", "function", '''
import contextlib
def run(query):
    with contextlib.suppress(KeyError), patchkit.capture():
        docs = retriever.retrieve(query)
        if not docs:
            return "no documents"
        return llm.generate(query, docs)
''', calls=frozenset({"retriever.retrieve", "llm.generate"})),
    Case("capture_inside_try_finally", "function", '''
def run(query):
    log = []
    try:
        with patchkit.capture():
            docs = retriever.retrieve(query)
            answer = llm.generate(query, docs)
    finally:
        log.append("done")
    return answer
''', calls=frozenset({"retriever.retrieve", "llm.generate"})),
    Case("capture_inside_try_except_in_loop", "function", '''
def run(query):
    for attempt in range(2):
        try:
            with patchkit.capture():
                checked = flaky.check(query)
                return llm.generate(checked, max_words=3)
        except KeyError:
            continue
''', calls=frozenset({"flaky.check", "llm.generate"})),
    Case("module_capture_inside_outer_with", "module", '''
import contextlib
with contextlib.nullcontext():
    with patchkit.capture():
        docs = retriever.retrieve(query)
        answer = llm.generate(query, docs)
''', output="answer"),
    # 2. components read through `self`; a captured pipeline called inside another capture
    Case("method_reads_components_through_self", "function", '''
class Assistant:
    def __init__(self, retriever, llm):
        self.retriever = retriever
        self.llm = llm
        self.style = "short"
    def search(self, query):
        return self.retriever.retrieve(query)
    def answer(self, query):
        with patchkit.capture():
            docs = self.search(query)
            return self.llm.generate(query, docs, max_words=4 if self.style == "short" else 9)
def run(query):
    return Assistant(retriever, llm).answer(query)
''', calls=frozenset({"retriever.retrieve", "llm.generate"}), components=frozenset({"retriever", "llm"})),
    Case("pipeline_called_inside_capture", "function", '''
def has_documents(query):
    with patchkit.capture() as check:
        docs = retriever.retrieve(query)
        enough = grader.grade(query, docs)
    return check
def run(query):
    check = has_documents("What is a generator?")
    with patchkit.capture():
        if check(query=query):
            return llm.generate(query)
        return "no documents for " + query
''', calls=frozenset({"retriever.retrieve", "grader.grade", "llm.generate"}),
         components=frozenset({"retriever", "grader", "llm"})),
    # 3. zero-argument super() in a method's capture
    Case("zero_argument_super", "function", '''
class Base:
    def __init__(self, retriever, llm):
        self.retriever = retriever
        self.llm = llm
    def fetch(self, query):
        return self.retriever.retrieve(query)
    def tag(self):
        return "base"
class Reranked(Base):
    def fetch(self, query):
        return sorted(super().fetch(query))
    def tag(self):
        return "reranked"
    def answer(self, query):
        with patchkit.capture():
            docs = super().fetch(query)
            parent = super()
            return self.llm.generate(query, docs) + " / " + parent.tag() + " / " + super().tag()
def run(query):
    return Reranked(retriever, llm).answer(query)
''', calls=frozenset({"retriever.retrieve", "llm.generate"})),
    # 4. components in containers, on a path the capture run does not take
    Case("components_in_containers", "function", '''
def run(query):
    tools = {"docs": retriever, "words": llm2}
    judges = [grader]
    with patchkit.capture():
        if "?" in query:
            found = tools["docs"].retrieve(query)
        else:
            found = [tools["words"].generate(query, max_words=2)]
        return found, judges[0].score(query)
''', components=frozenset({"docs", "words", "judges_0"})),
    # 5. a block that returns on one path and ends on another, the function returning after it
    Case("return_in_block_and_after_it", "function", '''
def run(query):
    with patchkit.capture():
        docs = retriever.retrieve(query)
        if not docs:
            return "no documents"
        answer = llm.generate(query, docs)
    return answer
'''),
]
FIDELITY = [replace(case, exact_inputs=True) for case in FIDELITY]
CASES += FIDELITY
