"""The llama.cpp engine behind LlamaCppGenerator: continuous batching, prefix reuse, streaming, aborts, stats."""

from __future__ import annotations

import contextlib
import math
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from serving import metric

import patchkit
from patchkit.components.documents import Hit
from patchkit.components.generators import Generator
from patchkit.components.generators.base import RAG_TEMPLATE
from patchkit.components.generators.llama.sequence import cut_pieces
from patchkit.components.generators.streaming import decoded, stripped
from patchkit.core.options import CallReport

QUESTIONS = [
    "What is a Python generator?", "Name three colors.", "How do I open a file in Python?", "What is 2+2?",
    "Explain recursion in one sentence.", "What is a list comprehension?", "Why is the sky blue?", "What does HTTP stand for?",
]
DOCS = [
    Hit("topic:try#0", "try", "The try statement specifies exception handlers and cleanup code for a group of statements.", 0.9),
    Hit("topic:except#0", "except", "An except clause names the exception classes it handles; a bare except handles all.", 0.8),
    Hit("module:logging#0", "logging", "The logging module records events; logger.exception logs a traceback.", 0.5),
]


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    pytest.importorskip("llama_cpp", reason="the engine needs llama-cpp-python: pip install -e '.[llm]'")
    from patchkit.components.generators import LlamaCppGenerator

    try:
        generator = LlamaCppGenerator(max_tokens=32, threads=1)
    except FileNotFoundError as exc:
        pytest.skip(f"the bundled model is absent: {exc}")
    generator.setup()
    yield generator
    generator.engine.close()


def stream(llm: Any, *args: Any, **kwargs: Any) -> Iterator[str]:
    """The text chunks of one generate call, as a deployment streams them (its report, after them, left out)."""
    chunks = type(llm).generate.chunks(llm, args, kwargs)
    try:
        yield from (chunk for chunk in chunks if isinstance(chunk, str))
    finally:
        chunks.close()


def wait_for(predicate: Any, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "the engine did not get there"
        time.sleep(0.01)


def test_utf8_split_across_tokens_is_decoded_whole() -> None:
    pieces = [b"caf", b"\xc3", b"\xa9 ", b"\xe2\x82", b"\xac", b"!"]
    chunks = list(decoded(pieces))
    assert "".join(chunks) == "café €!" and all("\ufffd" not in c for c in chunks)
    assert "".join(decoded([b"ok", b"\xe2\x82"])) == "ok\ufffd"  # bytes that never complete a character


def test_stripped_chunks_join_to_the_stripped_answer() -> None:
    chunks = ["  ", "\n Hi", " there ", "\n", "you  ", " ", "\n"]
    assert "".join(stripped(chunks)) == "".join(chunks).strip() == "Hi there \nyou"
    assert list(stripped([" ", "\n"])) == []


class Echo(Generator):
    def __init__(self, system_prompt: str | None = "Be brief.") -> None:
        super().__init__(max_tokens=8, temperature=0.0, seed=0, system_prompt=system_prompt)


def test_documents_lead_the_prompt_and_name_its_prefix() -> None:
    echo = Echo()
    content = echo.messages("Why?", DOCS)[-1]["content"]
    assert content.startswith("Documents:\n[1] try: The try statement") and content.endswith("Question: Why?")
    key = echo.prefix_key("generate", ("Why?", DOCS), {})
    assert key is not None and key == echo.prefix_key("generate", ("Grade these.",), {"docs": DOCS, "max_tokens": 4})
    assert key != echo.prefix_key("generate", ("Why?", DOCS[:2]), {})
    assert key != Echo("Be long.").prefix_key("generate", ("Why?", DOCS), {})
    assert echo.prefix_key("generate", ("Why?",), {}) is None and echo.prefix_key("generate", ("Why?", []), {}) is None


def test_concurrent_answers_equal_single_stream_ones(llm: Any) -> None:
    alone = [llm.generate(q) for q in QUESTIONS]
    before = llm.stats()
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(llm.generate, QUESTIONS))
    after = llm.stats()
    assert together == alone and all(alone)
    assert after["requests"] - before["requests"] == len(QUESTIONS)
    assert after["batched_steps"] > before["batched_steps"] and after["max_active"] >= 2


def test_a_lone_sequence_runs_on_every_thread_it_measures_faster_and_answers_alike(llm: Any) -> None:
    from patchkit.components.generators.llama.engine import EngineConfig, LlamaEngine

    prompts = [llm.tokens(llm.messages(q, DOCS if i % 2 else None)) for i, q in enumerate(QUESTIONS[:4])]
    engine = LlamaEngine(EngineConfig(llm.model_path, n_ctx=1024, max_sequences=4, threads=2))
    try:
        answers = [b"".join(engine.submit(p, 24).pieces()) for p in prompts]
        tried = {kind: dict(choice.ms) for kind, choice in engine._pace.kinds.items()}
        stats = engine.stats()
    finally:
        engine.close()
    # both counts measured for prompts and for decode steps, and the context runs on the faster
    assert {kind: set(ms) for kind, ms in tried.items()} == {"prefill": {1, 2}, "decode": {1, 2}}
    assert stats["threads_prefill"] in (1, 2) and stats["threads_decode"] in (1, 2)
    # the count of threads changes no answer: llama.cpp splits each product by rows, not within a row
    assert answers == [b"".join(llm.engine.submit(p, 24).pieces()) for p in prompts] and all(answers)


def test_a_call_submitted_mid_decode_joins_the_running_batch(llm: Any) -> None:
    engine = llm.engine
    long = engine.submit(llm.tokens(llm.messages("Count from 1 to 300, separated by commas.")), 300)
    pieces = long.pieces()
    next(pieces)  # decoding now
    before = llm.stats()
    short = "".join(stripped(decoded(engine.submit(llm.tokens(llm.messages("Say hello.")), 4).pieces())))
    after = llm.stats()
    assert short and after["finished"] - before["finished"] == 1
    assert after["running"] == 1, "the long sequence is still decoding after the short one finished"
    assert after["batched_steps"] > before["batched_steps"]
    pieces.close()
    wait_for(lambda: llm.stats()["running"] == 0)


def test_prefix_reuse_is_counted_and_changes_no_answer(llm: Any) -> None:
    from patchkit.components.generators import LlamaCppGenerator

    fresh = LlamaCppGenerator(max_tokens=32, threads=1, prefix_cache=False)
    fresh.setup()
    try:
        prompts = ['Do the documents above answer "How do I catch an exception?"?', "How do I catch an exception?"]
        expected = [fresh.generate(p, DOCS) for p in prompts]
        assert fresh.stats()["prompt_tokens_reused"] == 0
        before = llm.stats()
        assert [llm.generate(p, DOCS) for p in prompts] == expected  # the second reuses an idle slot's prompt
        # Asked again, all of the prompt but its last block comes from the cache; the answer is the same.
        assert [llm.generate(p, DOCS) for p in prompts] == expected
        after = llm.stats()
        shared = len(llm.tokens(llm.messages("", DOCS))) // 2  # well inside the shared documents
        assert after["prompt_tokens_reused"] - before["prompt_tokens_reused"] >= shared
        # A prompt sharing its prefix with a running sequence (and no idle slot) gets a copy of that one's stream.
        others = DOCS[1:]
        running = stream(llm, "List the documents' titles.", others, max_tokens=32)
        first = next(running)
        before = llm.stats()
        question = "What does a bare except handle?"
        assert llm.generate(question, others) == fresh.generate(question, others)
        after = llm.stats()
        assert after["prompt_tokens_reused"] - before["prompt_tokens_reused"] >= shared // 2
        assert after["stream_copies"] == before["stream_copies"] + 1
        assert first + "".join(running) == fresh.generate("List the documents' titles.", others)
    finally:
        assert fresh.engine is not None
        fresh.engine.close()


def test_answers_equal_create_chat_completion(llm: Any) -> None:
    from patchkit.components.generators.llama.loading import open_llama

    reference = open_llama(llm.model_path, n_ctx=2048, n_threads=1, n_threads_batch=1, verbose=False)
    for prompt, docs in [(QUESTIONS[0], None), ("How do I catch an exception?", DOCS)]:
        chat: Any = llm.messages(prompt, docs)
        reply: Any = reference.create_chat_completion(messages=chat, max_tokens=32, temperature=0.0, seed=0)
        assert llm.generate(prompt, docs) == reply["choices"][0]["message"]["content"].strip()


def test_streamed_chunks_join_to_the_answer(llm: Any) -> None:
    *chunks, report = type(llm).generate.chunks(llm, ("Describe Python in two sentences.",), {"max_tokens": 40})
    assert len(chunks) > 3 and all(isinstance(c, str) for c in chunks)
    assert "".join(chunks) == llm.generate("Describe Python in two sentences.", max_tokens=40)
    prompt = len(llm.tokens(llm.messages("Describe Python in two sentences.")))
    assert isinstance(report, CallReport) and report.prompt_tokens == prompt and 0 < report.completion_tokens <= 40


def test_closing_a_stream_aborts_its_sequence(llm: Any) -> None:
    before = llm.stats()
    chunks = stream(llm, "Count from 1 to 300, separated by commas.", max_tokens=300)
    next(chunks)
    chunks.close()
    wait_for(lambda: llm.stats()["aborted"] == before["aborted"] + 1)
    after = llm.stats()
    assert after["running"] == 0 and after["finished"] == before["finished"]
    assert after["generated_tokens"] - before["generated_tokens"] < 300
    assert after["requests"] == after["finished"] + after["aborted"] + after["running"] + after["waiting"]
    assert all(isinstance(v, (int, float)) for v in after.values())
    assert 1 <= after["mean_active_per_step"] <= 16 and after["generated_tokens"] >= after["decode_steps"]


def test_a_prompt_past_the_context_names_the_fix(llm: Any) -> None:
    with pytest.raises(ValueError, match="more than the model's context of 2048 tokens; shorten the question"):
        llm.generate("word " * 3000)


def test_seeded_sampling_repeats_and_a_closed_engine_fails_health(llm: Any) -> None:
    from patchkit.components.generators import LlamaCppGenerator

    warm = LlamaCppGenerator(max_tokens=16, temperature=0.9, seed=7, n_ctx=256, threads=1)
    warm.setup()
    assert warm.generate("Write a word.") == warm.generate("Write a word.")
    warm.check_health()
    assert warm.engine is not None
    warm.engine.close()
    with pytest.raises(RuntimeError, match="engine thread stopped"):
        warm.check_health()
    with pytest.raises(RuntimeError, match="engine"):
        warm.generate("Write a word.")


def test_a_finished_prompt_stays_cached_while_others_wait_for_a_slot(llm: Any) -> None:
    from patchkit.components.generators.llama.engine import EngineConfig, LlamaEngine

    # One sequence runs at a time and one more slot caches: B, taking the free slot, leaves A's prompt for C.
    engine = LlamaEngine(EngineConfig(llm.model_path, n_ctx=512, max_sequences=1, cache_slots=1, threads=1))
    try:
        grade, other, answer = (llm.tokens(llm.request(q, docs).messages) for q, docs in (
            ('Do the documents above answer "How do I catch an exception?"?', DOCS), ("Name three colors.", None),
            ("How do I catch an exception?", DOCS)))
        b"".join(engine.submit(grade, 4).pieces())
        streams = [engine.submit(other, 8), engine.submit(answer, 8)]
        for tokens in streams:
            b"".join(tokens.pieces())
        stats = engine.stats()
        assert stats["max_active"] == 1 and stats["cache_hits"] == 1
        assert stats["prompt_tokens_reused"] >= len(llm.tokens(llm.messages("", DOCS))) // 2
    finally:
        engine.close()


def test_prompts_admitted_together_copy_the_stream_of_the_first_that_reuses_a_prefix(llm: Any) -> None:
    from patchkit.components.generators.llama.engine import EngineConfig, LlamaEngine

    config = {"n_ctx": 512, "max_sequences": 4, "cache_slots": 0, "threads": 1}
    engine, fresh = (LlamaEngine(EngineConfig(llm.model_path, prefix_cache=cached, **config)) for cached in (True, False))
    try:
        grade, answer = (llm.tokens(llm.request(q, DOCS).messages) for q in (
            'Do the documents above answer "How do I catch an exception?"?', "How do I catch an exception?"))
        b"".join(engine.submit(grade, 1).pieces())  # an idle slot now holds the documents
        before = engine.stats()
        with engine._lock:  # the three arrive before the engine's next turn admits any
            streams = [engine.submit(answer, 8) for _ in range(3)]
        answers = [b"".join(s.pieces()) for s in streams]
        after = engine.stats()
        # The first takes the idle slot's prefix; the two others, placed in the same turn, copy its stream.
        shared = after["prompt_tokens_reused"] - before["prompt_tokens_reused"]
        assert shared >= 3 * (len(llm.tokens(llm.messages("", DOCS))) // 2)
        assert after["stream_copies"] - before["stream_copies"] == 2 and after["cache_hits"] - before["cache_hits"] == 3
        assert answers == [b"".join(fresh.submit(answer, 8).pieces())] * 3
    finally:
        engine.close()
        fresh.close()


@pytest.mark.parametrize("interval", [math.inf, 1.0])
def test_the_cost_model_replays_the_turns_the_engine_runs(llm: Any, interval: float) -> None:
    from patchkit.components.generators.llama.engine import EngineConfig, LlamaEngine
    from patchkit.components.generators.llama.engine_turn import TurnSize
    from patchkit.scheduler.offline.costmodel import EngineCall, EngineCosts
    from patchkit.scheduler.offline.pwl import PiecewiseLinear

    # Small turns, so that the three prompts' chunks spread over several turns and decoding starts between them;
    # at interval 1 a turn beside a decoding sequence reads one block, whatever the engine measured of its speed.
    config = EngineConfig(llm.model_path, n_ctx=1024, max_sequences=4, n_batch=96, block=32, threads=1, prefix_cache=False,
                          interval=interval)
    engine = LlamaEngine(config)
    try:
        prompts = [llm.tokens(llm.messages("Count from 1 to 300, separated by commas.", docs))
                   for docs in (DOCS, None, DOCS[:1])]
        with engine._lock:  # all three admitted at the engine's next turn, as the replay admits them
            streams = [engine.submit(prompt, 6) for prompt in prompts]
        for tokens in streams:
            b"".join(tokens.pieces())
        stats = engine.stats()
    finally:
        engine.close()
    assert stats["generated_tokens"] == 3 * 6  # every answer ran to its limit: 5 decode steps after its prompt
    assert TurnSize.reported(stats) == config.turn == TurnSize(96, 16, interval)
    costs = EngineCosts(1.0, PiecewiseLinear((1.0,), (1.0,)), 0.0, TurnSize.reported(stats))
    replayed = costs.replay([EngineCall(len(p), len(p), 5) for p in prompts], 3)
    counted = ("prompt_chunks", "decode_steps", "decoded_sequences", "mixed_steps", "step_prompt_tokens_max")
    assert [getattr(replayed, name) for name in counted] == [stats[name] for name in counted]
    # The prompts took two turns or more (224 tokens, 96 a turn): the first answers decoded while the last was read.
    assert stats["decode_steps"] > 5 and stats["decoded_sequences"] == 3 * 5
    assert stats["step_prompt_tokens_max"] <= (16 if interval == 1.0 else 96)


def test_a_decoding_sequence_waits_behind_one_prompt_slice_per_step(llm: Any) -> None:
    from patchkit.components.generators.llama.engine import EngineConfig, LlamaEngine

    writer = llm.tokens(llm.messages("Count from 1 to 300, separated by commas.", None))
    reader = llm.tokens(llm.messages("What does the logging module record?", LONG_DOCS))
    assert 10 * 16 < len(reader) <= 512  # ten slices or more, and one turn of n_batch without a budget
    counted = {}
    for interval in (1.0, math.inf):
        config = EngineConfig(llm.model_path, n_ctx=2048, max_sequences=2, block=16, threads=1, prefix_cache=False,
                              interval=interval)
        engine = LlamaEngine(config)
        try:
            writing = engine.submit(writer, 400).pieces()
            next(writing)  # the writer decodes from here on, past the reader's prompt
            b"".join(engine.submit(reader, 1).pieces())
            stats = engine.stats()
            writing.close()
        finally:
            engine.close()
        counted[interval] = stats["mixed_steps"], stats["step_prompt_tokens_max"], stats["prompt_chunks"]
    slices = -(-len(reader) // 16)
    # One block of the reader's prompt a turn, each followed by the writer's decode step: as many steps as slices.
    assert counted[1.0] == (slices, 16, -(-len(writer) // 16) + slices)  # the writer's own, read alone, before
    # Without a step budget the writer waited behind the reader's whole prompt (n_batch 512 holds it), in one turn.
    assert counted[math.inf][:2] == (1, len(reader))


# -- the document KV cache --------------------------------------------------------------------------------

LONG_DOCS = [Hit(f"module:{name}#0", name, text, score) for name, text, score in [
    ("json", "The json module encodes Python objects as JSON text and decodes JSON text into Python objects. "
             "json.dumps returns a string, json.dump writes to a file object, json.loads parses a string and json.load "
             "reads a file. Dictionaries become objects, lists and tuples become arrays, None becomes null. Keys must be "
             "strings; sort_keys and indent control the layout of the output.", 0.9),
    ("csv", "The csv module reads and writes tabular data in comma-separated values format. csv.reader iterates over "
            "the rows of a file as lists of strings, csv.writer writes sequences as delimited rows, and DictReader and "
            "DictWriter map rows to dictionaries keyed by the header line. A dialect sets the delimiter, the quote "
            "character and how quotes inside fields are escaped.", 0.8),
    ("pathlib", "The pathlib module represents filesystem paths as objects. Path joins parts with the slash "
                "operator, Path.read_text and Path.write_text read and write whole files, Path.glob finds files by "
                "pattern, and Path.exists, is_file and is_dir test what a path names. Pure paths compute names, "
                "suffixes and parents without touching the filesystem.", 0.7),
    ("logging", "The logging module records events from libraries and applications. Loggers are named in a "
                "hierarchy, handlers send records to files, streams or sockets, formatters lay them out, and levels "
                "from DEBUG to CRITICAL filter them. logger.exception logs a message at ERROR level with the traceback "
                "of the exception being handled.", 0.6),
    ("heapq", "The heapq module implements a priority queue on a plain list. heappush adds an item and heappop removes "
              "the smallest, both in logarithmic time; heapify turns a list into a heap in linear time; nlargest and "
              "nsmallest return the top items of an iterable. The smallest item is always at index zero.", 0.5),
]]


def small_engines(llm: Any, kv_cache_bytes: int) -> tuple[Any, Any]:
    """Two engines of one running slot and none to cache in, so that any other prompt takes the slot's
    prefix away: one with a document cache of `kv_cache_bytes`, one without."""
    from patchkit.components.generators.llama.engine import EngineConfig, LlamaEngine

    config = {"n_ctx": 1024, "max_sequences": 1, "cache_slots": 0, "threads": 1}
    return (LlamaEngine(EngineConfig(llm.model_path, kv_cache_bytes=kv_cache_bytes, **config)),
            LlamaEngine(EngineConfig(llm.model_path, **config)))


def answer(llm: Any, engine: Any, question: str, docs: list[Any]) -> str:
    """A greedy answer of `engine` to `question` over `docs`, its prompt and pieces built by `llm`."""
    tokens, pieces = llm.prompt(llm.messages(question, docs), docs)
    return b"".join(engine.submit(tokens, 24, pieces=pieces).pieces()).decode()


def test_a_prompt_names_its_system_prompt_and_documents_as_pieces(llm: Any) -> None:
    tokens, pieces = llm.prompt(llm.messages("Why?", DOCS), DOCS)
    text = [llm.engine.model.detokenize(tokens[a:b], special=True).decode() for a, b in zip([0, *pieces], pieces)]
    assert len(text) == 1 + len(DOCS) and text[0].startswith("<|im_start|>system\n") and text[0].endswith("Documents:\n")
    assert text[1:] == [f"[{i}] {d.title}: {d.text}\n" for i, d in enumerate(DOCS, 1)]
    assert llm.prompt(llm.messages("Why?"))[1] == []
    assert llm.stats()["kv_cache_budget_bytes"] == 512 << 20


def test_documents_tokenized_once_cut_the_prompt_where_its_text_does(llm: Any) -> None:
    for docs in (DOCS, LONG_DOCS[:3], [LONG_DOCS[2], "A plain string, ending in a question?"], LONG_DOCS):
        messages = llm.messages("Why?", docs)
        tokens, ends = llm.prompt(messages, docs)
        text = llm.chat(messages=messages).prompt
        context = text.find(messages[-1]["content"]) + RAG_TEMPLATE.index("{context}")
        assert ends == llm._cut_ends(text, context, docs, tokens, add_bos=False)
        assert all(llm.line(i, doc) == llm.line(i, doc) for i, doc in enumerate(docs, 1))
    assert (1, f"{DOCS[0].title}: {DOCS[0].text}") in llm.lines  # each line tokenized once, then kept


@pytest.mark.slow
def test_the_document_cache_restores_documents_the_slots_lost_and_changes_no_answer(llm: Any) -> None:
    cached, plain = small_engines(llm, 64 << 20)
    try:
        a, b, c, d, e = LONG_DOCS
        calls = [("What does json.dumps return?", [a, b, c]), ("How do I push onto a heap?", [e, d]),
                 ("How do I read a CSV file?", [a, b, e]),  # a, b after the system prompt: from the cache
                 ("Name three colors.", []), ("How do I join paths?", [c, a]),
                 ("Which module writes JSON?", [a, b, c])]  # the whole documents of the first call
        for question, docs in calls:
            assert answer(llm, cached, question, docs) == answer(llm, plain, question, docs)
        # The last prompt's KV cells, restored and then evaluated, are the bytes a fresh evaluation wrote.
        assert bytes(cached._documents.state(0)) == bytes(plain._documents.state(0))
        found, baseline = cached.stats(), plain.stats()
        assert found["kv_cache_hits"] == 2 and found["kv_cache_misses"] == 3
        # The shared documents, in whole blocks: the system prompt, a and b; then all but the question.
        restored = [llm.prompt(llm.messages(q, docs), docs)[1][n] for q, docs, n in ((*calls[2], 2), (*calls[5], 3))]
        assert found["kv_cache_tokens_saved"] == sum(end - end % 64 for end in restored)
        assert found["prompt_tokens_evaluated"] == baseline["prompt_tokens_evaluated"] - found["kv_cache_tokens_saved"]
        assert 0 < found["kv_cache_bytes_held"] <= 64 << 20 and found["kv_cache_entries"] >= 8
        assert found["kv_cache_evictions"] == 0 and baseline["kv_cache_hits"] == baseline["kv_cache_entries"] == 0
        # Each restore wrote its cells once, into one state of exactly the restored pieces' bytes.
        cache = cached._documents
        restored_runs = [[node.state for node in cache.tree.match(cut_pieces(*llm.prompt(llm.messages(q, docs), docs)))[:n]]
                         for q, docs, n in ((*calls[2], 3), (*calls[5], 4))]
        assert found["kv_cache_bytes_joined"] == sum(cache.layout.size([r for r in runs if r]) for runs in restored_runs)
    finally:
        cached.close()
        plain.close()


@pytest.mark.slow
def test_the_document_cache_holds_its_byte_budget(llm: Any) -> None:
    budget = 5 << 20  # about 220 tokens of SmolLM2's cells: two or three documents
    cached, plain = small_engines(llm, budget)
    try:
        a, b, c, d, e = LONG_DOCS
        for question, docs in [("Which is first?", [a, b]), ("Which is first?", [c, d]), ("Which is first?", [e, a]),
                               ("Which is first?", [a, b, c]), ("Which is first?", [d, e])]:
            assert answer(llm, cached, question, docs) == answer(llm, plain, question, docs)
            assert cached.stats()["kv_cache_bytes_held"] <= budget
        found = cached.stats()
        assert found["kv_cache_evictions"] >= 3 and found["kv_cache_entries"] >= 2 and found["kv_cache_bytes_held"] > budget // 2
    finally:
        cached.close()
        plain.close()


@pytest.mark.slow
def test_documents_ordered_for_reuse_put_the_cached_path_first(llm: Any) -> None:
    from patchkit.components.generators import LlamaCppGenerator

    reordering = LlamaCppGenerator(max_tokens=32, threads=1, n_ctx=1024, reorder_docs=True)
    reordering.setup()
    try:
        a, b, c, d, e = LONG_DOCS
        reordering.generate("What does json.dumps return?", [a, b, c])
        assert reordering.reuse_order("Q?", [c, a, b]) == [a, b, c]
        assert reordering.reuse_order("Q?", [d, b, a]) == [a, b, d]
        assert reordering.reuse_order("Q?", [e, d]) == [e, d]  # nothing held: the given order
        before = reordering.stats()
        # The call answers as over the reordered documents, whose leading ones it evaluates no more.
        assert reordering.generate("How do I read a CSV file?", [d, b, a]) == llm.generate("How do I read a CSV file?", [a, b, d])
        _, pieces = reordering.prompt(reordering.messages("How do I read a CSV file?", [a, b, d]), [a, b, d])
        assert reordering.stats()["prompt_tokens_reused"] - before["prompt_tokens_reused"] >= pieces[2] - pieces[2] % 64 > 0
    finally:
        assert reordering.engine is not None
        reordering.engine.close()


def test_calls_are_routed_by_their_first_document_where_prefixes_are_reused() -> None:
    from patchkit.components.generators import LlamaCppGenerator

    try:
        cached, slots, whole = (LlamaCppGenerator(), LlamaCppGenerator(kv_cache_bytes=0),
                                LlamaCppGenerator(prefix_cache=False))
    except FileNotFoundError as exc:
        pytest.skip(f"the bundled model is absent: {exc}")
    a, b, c = LONG_DOCS[:3]
    for reusing in (cached, slots):  # the document cache, or the slots alone, reuse a shared start
        key = reusing.prefix_key("generate", ("Why?", [a, b]), {})
        assert key is not None and key == reusing.prefix_key("generate", ("How?",), {"docs": [a, c]})
        assert key != reusing.prefix_key("generate", ("Why?", [b, a]), {})
        assert reusing.prefix_key("generate", ("Why?",), {}) is None
    assert whole.prefix_key("generate", ("Why?", [a, b]), {}) != whole.prefix_key("generate", ("Why?", [a, c]), {})
    with pytest.raises(ValueError, match=r"kv_cache_bytes \(-1\) must be >= 0"):
        LlamaCppGenerator(kv_cache_bytes=-1)


@pytest.mark.slow
@contextlib.contextmanager
def _deployed(llm: Any, texts: list[str]) -> Iterator[patchkit.Endpoint]:
    """`llm.generate(question, docs)` captured as a pipeline and deployed on a worker of its own."""

    def answer(question: str, docs: list[str]) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return llm.generate(question, docs)  # type: ignore[no-any-return]
        return pipeline

    answer("x", texts)
    # One replica: the cache's counters below are one engine's (unplanned, an engine runs a replica per core).
    with patchkit.deploy(patchkit.last_pipeline(), replicas=1) as endpoint:
        yield endpoint


def test_a_deployed_generator_reports_its_document_cache_in_metrics() -> None:
    from patchkit.components.generators import LlamaCppGenerator

    pytest.importorskip("llama_cpp", reason="the engine needs llama-cpp-python: pip install -e '.[llm]'")
    texts = [f"{d.title}: {d.text}" for d in LONG_DOCS[:2]]
    with _deployed(LlamaCppGenerator(max_tokens=8, threads=1, n_ctx=1024), texts) as endpoint:
        assert endpoint.query(question="What does json.dumps return?", docs=texts)
        with urllib.request.urlopen(endpoint.url + "/metrics", timeout=30) as reply:  # noqa: S310 - a local test server
            text = reply.read().decode()
        [replica] = endpoint.stats()["replica_reports"]
    held = metric(text, "patchkit_component_stat", component="llm", replica=replica, stat="kv_cache_bytes_held")
    assert 0 < held <= metric(text, "patchkit_component_stat", component="llm", replica=replica, stat="kv_cache_budget_bytes")
    assert metric(text, "patchkit_component_stat", component="llm", replica=replica, stat="kv_cache_entries") >= 2
    assert metric(text, "patchkit_component_stat", component="llm", replica=replica, stat="kv_cache_misses") == 1


# -- position-independent document KV (kv_reuse="blend") ------------------------------------------------

def blend_engine(llm: Any, **options: Any) -> Any:
    from patchkit.components.generators.llama.engine import EngineConfig, LlamaEngine

    config = {"n_ctx": 1024, "max_sequences": 1, "cache_slots": 0, "threads": 1, "kv_cache_bytes": 64 << 20,
              "kv_reuse": "blend", **options}
    return LlamaEngine(EngineConfig(llm.model_path, **config))


def keys(engine: Any, slot: int, start: int, end: int) -> list[np.ndarray]:
    """The keys of `slot`'s cells at positions [start, end), a float32 array per layer."""
    from patchkit.components.generators.llama.kv_state import StateLayout

    layout, cells = StateLayout.read(engine._documents.state(slot), engine._documents.n_layer)
    return [k.view(np.float16).astype(np.float32) for k in layout.cut(cells, start, end).keys]


def distance(a: list[np.ndarray], b: list[np.ndarray]) -> list[float]:
    """Per layer, the norm of a - b relative to b's."""
    return [float(np.linalg.norm(x - y) / np.linalg.norm(y)) for x, y in zip(a, b)]


def test_a_placed_document_holds_the_keys_it_would_have_evaluated_alone_at_its_place(llm: Any) -> None:
    from patchkit.components.generators.llama.kv_blend import Stop

    engine = blend_engine(llm, cache_slots=2)
    engine.stop()  # the test drives the context itself, as the engine thread would
    try:
        tokens, pieces = llm.prompt(llm.messages("Why?", LONG_DOCS[:1]), LONG_DOCS[:1])
        start, end = llm.bodies(tokens, pieces, LONG_DOCS[:1])[0]
        doc, head, k = tokens[start:end], tokens[:37], 5
        at = len(head)
        engine._evaluate_alone([*head, *doc[:k]], 0, 0)  # the prompt up to the document's recompute point
        # Evaluated alone at the parking positions, then its cells from k on moved behind the prompt's.
        assert engine._blender.place(0, [*head, *doc], Stop(at + k, at, at + len(doc), None)) == len(doc)
        engine._evaluate_alone([tokens[end]], at + len(doc), 0)  # the next token: llama.cpp rotates the keys first
        placed = keys(engine, 0, at + k, at + len(doc))
        engine._evaluate_alone(doc, at, 1)  # the document alone, evaluated at its place
        alone = keys(engine, 1, at + k, at + len(doc))
        engine._evaluate_alone(doc, at + 1, 2)  # and one position further
        off_by_one = keys(engine, 2, at + 1 + k, at + 1 + len(doc))
        error = distance(placed, alone)
        # The first layer's keys depend on the token and its position alone: equal within float16 rounding.
        # Deeper layers carry the rounding of other positions' rotations, as any other place would (1-2%).
        assert error[0] < 1e-3 and max(error) < 0.03, error
        assert min(distance(off_by_one, alone)) > 3 * max(error)
    finally:
        engine.close()


def test_blend_recomputing_whole_documents_answers_exactly_and_exact_mode_is_unchanged(llm: Any) -> None:
    everything, exact = blend_engine(llm, recompute=1.0), blend_engine(llm, kv_reuse="exact")
    try:
        a, b, c, _, e = LONG_DOCS
        for question, docs in [("What does json.dumps return?", [a, b, c]), ("How do I read a CSV file?", [c, a, b]),
                               ("How do I push onto a heap?", [e, a])]:
            assert answer(llm, everything, question, docs) == answer(llm, exact, question, docs)
        found = everything.stats()
        assert found["blend_documents_reused"] == found["blend_tokens_reused"] == 0
        assert "blend_documents_reused" not in exact.stats()
    finally:
        everything.close()
        exact.close()


def blend_answer(llm: Any, engine: Any, question: str, docs: list[Any]) -> str:
    tokens, pieces = llm.prompt(llm.messages(question, docs), docs)
    bodies = llm.bodies(tokens, pieces, docs)
    return b"".join(engine.submit(tokens, 24, pieces=pieces, documents=bodies).pieces()).decode()


def test_a_document_not_held_is_evaluated_in_place_as_exact_evaluates_it(llm: Any) -> None:
    engine, exact = blend_engine(llm), blend_engine(llm, kv_reuse="exact")
    try:
        a, b, c, d, e = LONG_DOCS
        calls = [("What does json.dumps return?", [a, b]), ("How do I read a CSV file?", [c, d]),
                 ("How do I push onto a heap?", [e])]  # no document recurs
        for question, docs in calls:
            assert blend_answer(llm, engine, question, docs) == answer(llm, exact, question, docs)
        found, plain = engine.stats(), exact.stats()
        assert found["blend_documents_in_place"] == 5
        assert found["blend_documents_evaluated"] == found["blend_documents_reused"] == found["blend_tokens_reused"] == 0
        assert found["prompt_tokens_evaluated"] == plain["prompt_tokens_evaluated"]
    finally:
        engine.close()
        exact.close()


def three_sights(llm: Any, engine: Any) -> list[list[float]]:
    """Three prompts over documents a, b (then b, a, then c, a, b): after each, the blend counters of documents
    evaluated in place, kept from there, evaluated alone and placed."""
    a, b, c, _, _ = LONG_DOCS
    seen = []
    for question, docs in [("Which is first?", [a, b]), ("Which is last?", [b, a]), ("Which is longer?", [c, a, b])]:
        assert blend_answer(llm, engine, question, docs).strip()
        found = engine.stats()
        seen.append([found[f"blend_documents_{kind}"] for kind in ("in_place", "kept_in_place", "evaluated", "reused")])
    return seen


def test_a_document_is_placed_from_its_second_sight_with_the_cells_its_first_left(llm: Any) -> None:
    engine = blend_engine(llm)
    try:
        seen = three_sights(llm, engine)
        # First sight: in place, its cells kept from there. Second, in another order: placed from them, nothing
        # evaluated alone. Third: c, new, in place (and kept), a and b placed behind it.
        assert seen == [[2, 2, 0, 0], [2, 2, 0, 2], [3, 3, 0, 4]]
    finally:
        engine.close()


def test_without_keys_turned_on_the_host_a_document_is_evaluated_alone_on_its_second_sight(llm: Any) -> None:
    engine = blend_engine(llm)
    try:
        engine._blender.rotation = None  # as for a model whose keys KeyRotation does not turn
        seen = three_sights(llm, engine)
        # First sight: in place, nothing kept. Second, in another order: evaluated alone and placed by llama.cpp's
        # shift. Third: placed from the cache (c, new, in place before them).
        assert seen == [[2, 0, 0, 0], [2, 0, 2, 0], [3, 0, 2, 2]]
        found = engine.stats()
        assert found["blend_context_shifts"] == 4 and found["blend_cells_rotated"] == 0
    finally:
        engine.close()


def test_sightings_remember_a_bounded_window_of_documents() -> None:
    from patchkit.components.generators.llama.kv_blend import Sightings

    seen = Sightings(capacity=2)
    assert [seen.recurs(body) for body in ([1, 2], [3], [1, 2])] == [False, False, True]
    assert not seen.recurs([4]) and len(seen) == 2  # [3], the least recent sight, forgotten
    assert [seen.recurs(body) for body in ([3], [1, 2])] == [False, False]
    with pytest.raises(ValueError, match=r"capacity \(0\) must be >= 1"):
        Sightings(capacity=0)


@pytest.mark.slow
def test_blend_reuses_documents_at_any_place_within_its_byte_budget(llm: Any) -> None:
    budget = 8 << 20  # about 350 tokens of cells: three of the documents
    engine = blend_engine(llm, kv_cache_bytes=budget)
    try:
        a, b, c, d, e = LONG_DOCS
        calls = [("Which is first?", [a, b]), ("Which is first?", [b, a]), ("Which is last?", [b, a]),
                 ("Which is first?", [c, d]), ("Which is first?", [e, c]), ("Which is first?", [a, e])]
        for question, docs in calls:
            assert blend_answer(llm, engine, question, docs).strip()
            assert engine.stats()["kv_cache_bytes_held"] <= budget
        found = engine.stats()
        # A document not held is evaluated in place, its cells kept from there; held, it is placed. Nothing is
        # evaluated alone, and what the budget evicted is evaluated in place again.
        assert found["blend_documents_in_place"] == found["blend_documents_kept_in_place"] >= len(LONG_DOCS)
        assert found["kv_cache_evictions"] >= 1 and found["blend_documents_evaluated"] == 0
        assert found["blend_documents_in_place"] + found["blend_documents_reused"] == 2 * len(calls)
        assert found["blend_documents_reused"] >= 4
        assert 0 < found["blend_tokens_recomputed"] < found["blend_tokens_reused"]
    finally:
        engine.close()


def test_blend_options_are_checked_where_they_are_given() -> None:
    from patchkit.components.generators import LlamaCppGenerator

    try:
        with pytest.raises(ValueError, match=r"kv_reuse \('fast'\) must be 'exact' or 'blend'"):
            LlamaCppGenerator(kv_reuse="fast")
    except FileNotFoundError as exc:
        pytest.skip(f"the bundled model is absent: {exc}")
    with pytest.raises(ValueError, match=r"prefix_cache \(True\) must be True and kv_cache_bytes \(0\) > 0"):
        LlamaCppGenerator(kv_reuse="blend", kv_cache_bytes=0)
    with pytest.raises(ValueError, match=r"recompute \(1.5\) must be within \[0, 1\]"):
        LlamaCppGenerator(kv_reuse="blend", recompute=1.5)


@pytest.mark.slow
def test_a_deployed_blend_generator_places_documents_it_saw_in_another_order() -> None:
    from patchkit.components.generators import LlamaCppGenerator

    pytest.importorskip("llama_cpp", reason="the engine needs llama-cpp-python: pip install -e '.[llm]'")
    a, b, c = (f"{d.title}: {d.text}" for d in LONG_DOCS[:3])
    with _deployed(LlamaCppGenerator(max_tokens=8, threads=1, n_ctx=1024, kv_reuse="blend"), [a, b]) as endpoint:
        assert endpoint.query(question="What does json.dumps return?", docs=[a, b])
        assert endpoint.query(question="How do I read a CSV file?", docs=[b, a])
        assert endpoint.query(question="Which module writes JSON?", docs=[c, a, b])
        with urllib.request.urlopen(endpoint.url + "/metrics", timeout=30) as reply:  # noqa: S310 - a local test server
            text = reply.read().decode()
        [replica] = endpoint.stats()["replica_reports"]
    stat = {name: metric(text, "patchkit_component_stat", component="llm", replica=replica, stat=name)
            for name in ("blend_documents_reused", "blend_documents_evaluated", "blend_documents_in_place",
                         "blend_tokens_reused")}
    # The first call evaluates both documents in place and keeps their cells; the second, in the other order, places
    # both from them; the third evaluates a new one in place, then places the two behind it from the cache (no exact
    # prefix of theirs is cached: no earlier prompt began with the new one).
    assert stat["blend_documents_in_place"] == 3
    assert stat["blend_documents_evaluated"] == 0 and stat["blend_documents_reused"] == 4
    assert stat["blend_tokens_reused"] > 100


def test_keys_rotated_on_the_host_equal_llama_cpps_shift(llm: Any) -> None:
    from patchkit.components.generators.llama.kv_rope import KeyRotation
    from patchkit.components.generators.llama.kv_state import StateLayout

    engine = blend_engine(llm, max_sequences=2)
    engine.stop()  # the test drives the context itself, as the engine thread would
    try:
        rotation = KeyRotation.of(engine._lib, engine.model)
        assert rotation is not None  # SmolLM2: F16 keys, plain RoPE
        tokens, pieces = llm.prompt(llm.messages("Why?", LONG_DOCS[:1]), LONG_DOCS[:1])
        start, end = llm.bodies(tokens, pieces, LONG_DOCS[:1])[0]
        engine._evaluate_alone(tokens[start:end], 300, 0)
        layout, cells = StateLayout.read(engine._documents.state(0), engine._documents.n_layer)
        moved = rotation.moved(layout, layout.cut(cells, cells.start, cells.end), 41)
        engine._lib.llama_memory_seq_add(engine._ctx.memory, 0, -1, -1, 41 - 300)
        engine._evaluate_alone(tokens[:2], 0, 1)  # any decode has llama.cpp apply the shift first
        _, shifted = StateLayout.read(engine._documents.state(0), engine._documents.n_layer)
        assert (shifted.start, shifted.end) == (moved.start, moved.end) == (41, 41 + end - start)
        assert np.array_equal(shifted.meta, moved.meta)
        assert all(np.array_equal(a, b) for a, b in zip(shifted.values, moved.values))
        ours = np.concatenate([k.view(np.float16).astype(np.float32).ravel() for k in moved.keys])
        theirs = np.concatenate([k.view(np.float16).astype(np.float32).ravel() for k in shifted.keys])
        before = np.concatenate([k.view(np.float16).astype(np.float32).ravel() for k in cells.keys])
        # The same float16 keys but for a last-bit rounding of a few elements in a hundred thousand.
        assert np.mean(ours != theirs) < 1e-4 and np.allclose(ours, theirs, rtol=2e-3, atol=1e-3)
        assert np.mean(before != theirs) > 0.5  # the keys did turn
    finally:
        engine.close()


def test_placing_documents_rotates_their_cells_alone_and_leaves_the_context_unshifted(llm: Any) -> None:
    engine = blend_engine(llm, max_sequences=2, cache_slots=2)
    try:
        a, b, c, _, _ = LONG_DOCS
        seen: set[str] = set()
        tokens = 0  # the body tokens of the documents placed: those seen before
        for question, docs in [("Which is first?", [a, b]), ("Which is last?", [b, c, a]), ("Which is longer?", [c, b, a])]:
            assert blend_answer(llm, engine, question, docs).strip()
            bodies = llm.bodies(*llm.prompt(llm.messages(question, docs), docs), docs)
            tokens += sum(end - start for doc, (start, end) in zip(docs, bodies) if doc.title in seen)
            seen.update(doc.title for doc in docs)
        found = engine.stats()
        placed = found["blend_documents_reused"] + found["blend_documents_evaluated"]
        assert found["blend_documents_reused"] >= 2 and placed == 5 and found["blend_documents_in_place"] == 3
        # Each placed document's cells past its recomputed tokens, and nothing else, turned to their positions:
        # llama.cpp's shift, which turns every cell of every slot, never ran.
        assert found["blend_context_shifts"] == 0
        assert found["blend_cells_rotated"] == tokens - found["blend_tokens_recomputed"]
    finally:
        engine.close()


@pytest.mark.slow
def test_a_deployed_blend_that_recomputes_whole_documents_answers_as_exact() -> None:
    from patchkit.components.generators import LlamaCppGenerator

    pytest.importorskip("llama_cpp", reason="the engine needs llama-cpp-python: pip install -e '.[llm]'")
    a, b, c, d, _ = LONG_DOCS
    calls = [("What does json.dumps return?", [a, b, c]), ("How do I read a CSV file?", [c, a, b]),
             ("Which module parses dates?", [d, b])]
    answers = {}
    for kv_reuse, recompute in (("exact", 0.15), ("blend", 1.0)):
        llm = LlamaCppGenerator(max_tokens=16, threads=1, n_ctx=1024, kv_reuse=kv_reuse, recompute=recompute)
        with _deployed(llm, [f"{x.title}: {x.text}" for x in [a, b]]) as endpoint:
            answers[kv_reuse] = [endpoint.query(question=q, docs=[f"{x.title}: {x.text}" for x in docs])
                                 for q, docs in calls]
    assert answers["blend"] == answers["exact"] and all(answers["exact"])
