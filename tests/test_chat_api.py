"""The OpenAI chat API over a deployed pipeline, with the `openai` SDK as the client."""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from components import Generator

import patchkit
from patchkit import Component, make
from patchkit.client.streams import sse_events
from patchkit.config import DeploymentConfig
from patchkit.core import ensure_setup
from patchkit.core.options import CallOptions, CallReport
from patchkit.errors import ConfigError
from patchkit.server.process import FrontendServer

llm = Generator()


class Answerer(Component):
    @make
    def answer(self, question: str, style: str) -> dict[str, str]:
        return {"answer": f"{style}: {question}", "source": "test"}


answerer = Answerer()


def one_input() -> patchkit.Pipeline:
    question = "What is a generator?"
    with patchkit.capture(run=False) as pipeline:
        return llm.generate(question)  # type: ignore[no-any-return]
    return pipeline


def two_inputs() -> patchkit.Pipeline:
    question, style = "q", "short"
    with patchkit.capture(run=False) as pipeline:
        return answerer.answer(question, style)  # type: ignore[no-any-return]
    return pipeline


@pytest.fixture(scope="module")
def endpoint() -> Iterator[patchkit.Endpoint]:
    one_input()
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess", name="crag") as served:
        yield served


CLIENTS: dict[str, openai.OpenAI] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while CLIENTS:
        CLIENTS.popitem()[1].close()


def client(endpoint: patchkit.Endpoint) -> openai.OpenAI:
    """The SDK's client of `endpoint`, one per endpoint, closed with the module's tests."""
    url = endpoint.url + "/v1"
    if url not in CLIENTS:
        CLIENTS[url] = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    return CLIENTS[url]


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "What is a loop?"}]


def test_models_lists_the_deployment(endpoint: patchkit.Endpoint) -> None:
    assert [model.id for model in client(endpoint).models.list()] == ["crag"]


def test_a_completion_answers_the_last_user_message(endpoint: patchkit.Endpoint) -> None:
    completion = client(endpoint).chat.completions.create(model="crag", messages=MESSAGES)  # type: ignore[arg-type]
    assert completion.choices[0].message.content == endpoint.query(question="What is a loop?")
    assert completion.choices[0].message.role == "assistant" and completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.total_tokens == completion.usage.prompt_tokens + \
        completion.usage.completion_tokens > 0
    assert completion.object == "chat.completion" and completion.model == "crag"


def test_a_streamed_completion_adds_up_to_the_same_answer(endpoint: patchkit.Endpoint) -> None:
    chunks = list(client(endpoint).chat.completions.create(
        model="crag", messages=MESSAGES, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == endpoint.query(question="What is a loop?")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and not chunks[-1].choices
    with httpx.stream("POST", endpoint.url + "/v1/chat/completions", json={"messages": MESSAGES, "stream": True}) as raw:
        assert list(raw.iter_lines())[-2:] == ["data: [DONE]", ""]


@pytest.mark.parametrize(
    ("body", "error", "words"),
    [
        ({"model": "crag", "messages": []}, openai.BadRequestError, "messages must be a non-empty list"),
        ({"model": "crag", "messages": [{"role": "system", "content": "x"}]}, openai.BadRequestError, "no user message"),
        ({"model": "gpt-4", "messages": MESSAGES}, openai.NotFoundError, "does not exist"),
        ({"model": "crag", "messages": MESSAGES, "n": 2}, openai.BadRequestError, "n must be 1"),
    ],
)
def test_bad_requests_get_openai_errors(endpoint: patchkit.Endpoint, body: dict[str, object], error: type[Exception],
                                        words: str) -> None:
    with pytest.raises(error, match=words) as caught:
        client(endpoint).chat.completions.create(**body)  # type: ignore[call-overload]
    assert isinstance(caught.value, openai.APIStatusError)
    assert caught.value.body["type"] in ("invalid_request_error", "not_found_error")  # type: ignore[index]


def test_chat_input_and_chat_output_pick_the_fields() -> None:
    two_inputs()
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess", chat_input="question", chat_output="answer") as served:
        completion = client(served).chat.completions.create(model="patchkit", messages=[{"role": "user", "content": "why"}])
        assert completion.choices[0].message.content == "short: why"


def test_a_dict_output_needs_chat_output() -> None:
    two_inputs()
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess", chat_input="question") as served:
        with pytest.raises(openai.BadRequestError, match="chat_output"):
            client(served).chat.completions.create(model="patchkit", messages=[{"role": "user", "content": "why"}])


def test_several_inputs_need_chat_input() -> None:
    two_inputs()
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess") as served:
        with pytest.raises(openai.BadRequestError, match="chat_input"):
            client(served).chat.completions.create(model="patchkit", messages=[{"role": "user", "content": "why"}])


def test_an_unknown_chat_input_is_refused_at_deploy() -> None:
    two_inputs()
    with pytest.raises(ConfigError, match="its inputs: question, style"):
        patchkit.deploy(patchkit.last_pipeline(), backend="inprocess", chat_input="query")


def test_a_missing_chat_output_field_is_a_server_error() -> None:
    two_inputs()
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess", chat_input="question", chat_output="text") as served:
        with pytest.raises(openai.InternalServerError, match="no field 'text'") as caught:
            client(served).chat.completions.create(model="patchkit", messages=[{"role": "user", "content": "why"}])
        assert caught.value.body["type"] == "server_error"  # type: ignore[index]


@pytest.mark.slow
def test_the_openai_sdk_streams_a_real_generators_tokens_from_its_worker() -> None:
    """SmolLM2 through llama.cpp on a worker process: the chunks arrive as the engine makes them, and
    join to the answer the same request gets without streaming."""
    pytest.importorskip("llama_cpp", reason="needs the llm extra (llama-cpp-python)")
    from patchkit.components import LlamaCppGenerator

    real = LlamaCppGenerator(max_tokens=24)

    def answer(question: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return real.generate(question)  # type: ignore[no-any-return]
        return pipeline

    question = "What is a Python generator?"
    with patchkit.deploy(answer(question)) as served:
        sdk = client(served)
        whole = sdk.chat.completions.create(model="patchkit", messages=[{"role": "user", "content": question}])
        stream = sdk.chat.completions.create(model="patchkit", messages=[{"role": "user", "content": question}], stream=True)
        deltas = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert len(deltas) > 3  # token by token, not the answer in one piece
    assert "".join(deltas) == whole.choices[0].message.content


class Conversant(Component):
    """Answers with the conversation it was given, so a reply shows what reached the pipeline."""

    @make
    def reply(self, messages: list[dict[str, str]]) -> str:
        return json.dumps(messages)

    @make
    def call_tools(self, messages: list[dict[str, str]], tools: list[dict[str, object]]) -> str:
        names = [tool["function"]["name"] for tool in tools]  # type: ignore[index]
        return f"{len(messages)} messages, tools: {', '.join(names)}"


conversant = Conversant()
CONVERSATION = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "And goodbye?", "name": "ana"}]
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the docs",
                                          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def conversation() -> patchkit.Pipeline:
    messages = [{"role": "user", "content": "Hi"}]
    with patchkit.capture(run=False) as pipeline:
        return conversant.reply(messages)  # type: ignore[no-any-return]
    return pipeline


def with_tools() -> patchkit.Pipeline:
    messages = [{"role": "user", "content": "Hi"}]
    tools: list[dict[str, object]] = []
    with patchkit.capture(run=False) as pipeline:
        return conversant.call_tools(messages, tools)  # type: ignore[no-any-return]
    return pipeline


def test_a_messages_pipeline_gets_the_whole_conversation_as_sent() -> None:
    with patchkit.deploy(conversation(), backend="inprocess") as served:
        sdk = client(served)
        completion = sdk.chat.completions.create(model="patchkit", messages=CONVERSATION)  # type: ignore[arg-type]
        assert json.loads(completion.choices[0].message.content or "") == CONVERSATION  # every turn, every key
        stream = sdk.chat.completions.create(model="patchkit", messages=CONVERSATION, stream=True)  # type: ignore[arg-type]
        assert json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)) == CONVERSATION


def test_a_single_question_pipeline_gets_the_last_user_message(endpoint: patchkit.Endpoint) -> None:
    completion = client(endpoint).chat.completions.create(model="crag", messages=CONVERSATION)  # type: ignore[arg-type]
    assert completion.choices[0].message.content == endpoint.query(question="And goodbye?")
    assert completion.choices[0].message.content != endpoint.query(question="Hello")


@pytest.mark.parametrize(
    "extra",
    [{"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "required"}, {"tool_choice": "none"},
     {"functions": [TOOLS[0]["function"]]}, {"function_call": "auto"}],
)
def test_tools_to_a_pipeline_that_takes_none_are_refused_naming_them(endpoint: patchkit.Endpoint,
                                                                     extra: dict[str, object]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(endpoint).chat.completions.create(model="crag", messages=CONVERSATION, **extra)  # type: ignore[call-overload]
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert error["param"] == next(iter(extra)) and next(iter(extra)) in error["message"]
    assert caught.value.status_code == 400


def test_a_pipeline_with_a_tools_input_gets_them() -> None:
    with patchkit.deploy(with_tools(), backend="inprocess") as served:
        sdk = client(served)
        completion = sdk.chat.completions.create(model="patchkit", messages=CONVERSATION, tools=TOOLS)  # type: ignore[arg-type]
        assert completion.choices[0].message.content == "4 messages, tools: search"
        auto = sdk.chat.completions.create(model="patchkit", messages=CONVERSATION, tools=TOOLS,  # type: ignore[arg-type]
                                           tool_choice="auto")
        assert auto.choices[0].message.content == "4 messages, tools: search"
        with pytest.raises(openai.BadRequestError) as caught:  # "required" is a promise it has no input to keep
            sdk.chat.completions.create(model="patchkit", messages=CONVERSATION, tools=TOOLS,  # type: ignore[arg-type]
                                        tool_choice="required")
        assert caught.value.body["param"] == "tool_choice"  # type: ignore[index]


class Words(Component):
    """A generator whose every answer is known: it streams its prompt back word by word, honours max_tokens
    and stop as a model does (a word a token), and reports what it made."""

    honoured_options = frozenset({"max_tokens", "stop"})

    @make(stream=True, read_only=True)
    def generate(self, prompt: str, options: CallOptions | None = None) -> Iterator[str | CallReport]:
        options = options or CallOptions()
        words, made = prompt.split(), 0
        for word in words[: options.max_tokens or len(words)]:
            if word in options.stop:
                yield CallReport(len(words), made, "stop")
                return
            yield (" " if made else "") + word
            made += 1
        yield CallReport(len(words), made, "length" if made < len(words) else "stop")


words = Words()


def draft_then_answer() -> patchkit.Pipeline:
    question = "q"
    with patchkit.capture(run=False) as pipeline:
        draft = words.generate("one two three four five")
        return {"answer": words.generate(question + " " + draft), "draft": draft}  # type: ignore[no-any-return]
    return pipeline


class Tuned(Component):
    @make
    def answer(self, question: str, temperature: float) -> str:
        return f"{question} at {temperature}"


tuned = Tuned()


def with_temperature() -> patchkit.Pipeline:
    question, temperature = "q", 0.0
    with patchkit.capture(run=False) as pipeline:
        return tuned.answer(question, temperature)  # type: ignore[no-any-return]
    return pipeline


@pytest.fixture(scope="module")
def drafts() -> Iterator[patchkit.Endpoint]:
    with patchkit.deploy(draft_then_answer(), backend="inprocess", chat_output="answer") as served:
        yield served


USER = [{"role": "user", "content": "q"}]


def test_options_reach_only_the_call_that_answers(drafts: patchkit.Endpoint) -> None:
    sdk = client(drafts)
    capped = sdk.chat.completions.create(model="patchkit", messages=USER, max_tokens=2)  # type: ignore[arg-type]
    assert capped.choices[0].message.content == "q one" and capped.choices[0].finish_reason == "length"
    # The answering call's own counts: its prompt of 6 words (the draft, made without the cap, in it), 2 made.
    assert capped.usage is not None and (capped.usage.prompt_tokens, capped.usage.completion_tokens) == (6, 2)
    assert capped.usage.model_extra is None or "estimated" not in capped.usage.model_extra
    newer = sdk.chat.completions.create(model="patchkit", messages=USER, max_completion_tokens=3,  # type: ignore[arg-type]
                                        max_tokens=1)
    assert newer.choices[0].message.content == "q one two"  # max_completion_tokens wins, as at OpenAI
    stopped = sdk.chat.completions.create(model="patchkit", messages=USER, stop=["three"])  # type: ignore[arg-type]
    assert stopped.choices[0].message.content == "q one two" and stopped.choices[0].finish_reason == "stop"
    whole = httpx.post(drafts.url + "/v1/query", json={"inputs": {"question": "q"}, "options": {"max_tokens": 2},
                                                       "field": "answer"}).json()
    assert whole["output"] == {"answer": "q one", "draft": "one two three four five"}


def test_a_dict_output_streams_only_the_field_it_answers_with(drafts: patchkit.Endpoint) -> None:
    sdk = client(drafts)
    whole = sdk.chat.completions.create(model="patchkit", messages=USER)  # type: ignore[arg-type]
    stream = list(sdk.chat.completions.create(model="patchkit", messages=USER, stream=True,  # type: ignore[arg-type]
                                              stream_options={"include_usage": True}, max_tokens=4))
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content == "q one two three four five"
    assert streamed == "q one two three"  # the answer's call alone, capped; never the draft's words
    assert len([c for c in stream if c.choices and c.choices[0].delta.content]) == 4  # as the call made them
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    assert stream[-1].usage is not None and stream[-1].usage.completion_tokens == 4


def test_a_query_stream_names_the_field_of_each_delta(drafts: patchkit.Endpoint) -> None:
    with httpx.stream("POST", drafts.url + "/v1/query", json={"inputs": {"question": "q"}, "stream": True}) as raw:
        events = [json.loads(event.data) for event in sse_events(raw.iter_lines()) if event.event != "end"]
    deltas = [event for event in events if "delta" in event]
    by_field = {name: "".join(d["delta"] for d in deltas if d["field"] == name) for name in ("draft", "answer")}
    assert by_field == events[-1]["output"] == {"answer": "q one two three four five", "draft": "one two three four five"}
    with httpx.stream("POST", drafts.url + "/v1/query",
                      json={"inputs": {"question": "q"}, "stream": True, "field": "answer"}) as raw:
        events = [json.loads(event.data) for event in sse_events(raw.iter_lines()) if event.event != "end"]
    assert "".join(e["delta"] for e in events if "delta" in e) == "q one two three four five"
    assert all("field" not in e for e in events)


def test_an_option_the_answering_call_does_not_honour_is_refused_naming_it(drafts: patchkit.Endpoint,
                                                                          endpoint: patchkit.Endpoint) -> None:
    for served, option in ((drafts, {"temperature": 0.5}), (drafts, {"seed": 3}), (endpoint, {"max_tokens": 5})):
        with pytest.raises(openai.BadRequestError) as caught:
            client(served).chat.completions.create(model=None, messages=USER, **option)  # type: ignore[call-overload]
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == next(iter(option)) and error["code"] == "unsupported_parameter"
    reply = httpx.post(drafts.url + "/v1/query", json={"inputs": {"question": "q"}, "options": {"seed": 3}, "field": "answer"})
    assert reply.status_code == 400 and "options.seed" in reply.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as caught:  # not an option at all
        client(drafts).chat.completions.create(model="patchkit", messages=USER, extra_body={"top_k": 4})  # type: ignore[arg-type]
    assert caught.value.body["param"] == "top_k"  # type: ignore[index]


def test_options_fill_pipeline_inputs_of_their_names() -> None:
    with patchkit.deploy(with_temperature(), backend="inprocess") as served:
        completion = client(served).chat.completions.create(model="patchkit", messages=USER, temperature=0.5)  # type: ignore[arg-type]
        assert completion.choices[0].message.content == "q at 0.5"
        assert completion.usage is not None and completion.usage.model_extra == {"estimated": True}  # no call reported


def test_listed_drop_params_are_accepted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with patchkit.deploy(draft_then_answer(), backend="inprocess", chat_output="answer",
                         chat_drop_params=["temperature", "logit_bias"]) as served:
        sdk = client(served)
        for _ in range(2):
            completion = sdk.chat.completions.create(model="patchkit", messages=USER, temperature=0.7,  # type: ignore[arg-type]
                                                     logit_bias={"1": 5}, max_tokens=2)
            assert completion.choices[0].message.content == "q one"
    dropped = [r.getMessage() for r in caplog.records if "chat_drop_params" in r.getMessage()]
    assert len(dropped) == 2 and any("'temperature'" in m for m in dropped) and any("'logit_bias'" in m for m in dropped)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
        ({"temperature": 3}, "temperature", "<= 2"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ],
)
def test_options_out_of_range_are_refused_as_openai_does(drafts: patchkit.Endpoint, body: dict[str, object], param: str,
                                                         words: str) -> None:
    reply = httpx.post(drafts.url + "/v1/chat/completions", json={"messages": USER, **body})
    assert reply.status_code == 400 and words in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == param and reply.json()["error"]["type"] == "invalid_request_error"


def test_openai_error_codes_for_a_body_that_is_not_json_and_an_unknown_model(drafts: patchkit.Endpoint) -> None:
    reply = httpx.post(drafts.url + "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error" and reply.json()["error"]["code"] is None
    with pytest.raises(openai.NotFoundError) as caught:
        client(drafts).chat.completions.create(model="gpt-4", messages=USER)  # type: ignore[arg-type]
    assert caught.value.body == {"message": caught.value.body["message"], "type": "invalid_request_error",  # type: ignore[index]
                                 "param": "model", "code": "model_not_found"}


def test_health_answers_as_vllms(drafts: patchkit.Endpoint) -> None:
    reply = httpx.get(drafts.url + "/health")
    assert reply.status_code == 200 and reply.content == b""


class Slow(Component):
    @make(stream=True, read_only=True)
    async def generate(self, prompt: str) -> AsyncIterator[str]:
        for word in prompt.split() * 100:
            await asyncio.sleep(0.01)
            yield word + " "


slow = Slow()


def slow_answer() -> patchkit.Pipeline:
    question = "a b c"
    with patchkit.capture(run=False) as pipeline:
        return slow.generate(question)  # type: ignore[no-any-return]
    return pipeline


def test_abandoned_streams_leave_no_task_behind() -> None:
    served = slow_answer()
    server = FrontendServer(served, DeploymentConfig.resolve(served, backend="inprocess"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def tasks() -> list[str]:
        await asyncio.sleep(0.3)  # the abandoned requests' cancellation runs to its end
        return sorted(repr(task.get_coro()) for task in asyncio.all_tasks() if task is not asyncio.current_task())

    collecting = gc.isenabled()
    gc.disable()  # a leaked task lives until a collection: count them before one
    try:
        url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
        before = asyncio.run_coroutine_threadsafe(tasks(), loop).result(10)
        for _ in range(50):
            with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True}) as raw:
                next(raw.iter_lines())  # the first chunk, then the client goes away
        after = asyncio.run_coroutine_threadsafe(tasks(), loop).result(10)
        left = list((collections.Counter(after) - collections.Counter(before)).elements())
        assert not left, f"{len(left)} tasks left behind, such as {left[0][:200]}"
    finally:
        if collecting:
            gc.enable()
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


@pytest.fixture(scope="module")
def smollm() -> Iterator[tuple[patchkit.Endpoint, Any]]:
    """The bundled SmolLM2 behind a one-LLM chat pipeline, and beside it one whose dict output holds two of its
    answers, deployed as the docs write them (the default backend: a worker process); with the generator
    loaded here too, for its tokenizer."""
    pytest.importorskip("llama_cpp", reason="needs the llm extra (llama-cpp-python)")
    from patchkit.components import LlamaCppGenerator

    llm = LlamaCppGenerator(max_tokens=48)

    def answer(question: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return llm.generate(question)  # type: ignore[no-any-return]
        return pipeline

    def answer_and_followup(question: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            reply = llm.generate(question)
            followup = llm.generate("Ask one question about this: " + question)
            return {"answer": reply, "followup": followup}  # type: ignore[return-value]
        return pipeline

    question = "What is the sea?"
    local = LlamaCppGenerator()
    local.setup()
    try:
        with patchkit.deploy({"chat": answer(question), "both": answer_and_followup(question)},
                             chat_output="answer") as served:
            yield served, local
    finally:
        local.teardown()


POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.mark.slow
def test_the_openai_sdk_gets_what_it_asks_of_a_real_generator(smollm: tuple[patchkit.Endpoint, Any]) -> None:
    """The six things an OpenAI client relies on, on llama.cpp in a worker: max_tokens (either name) caps
    the reply with "length"; usage is the tokenizer's count; stop stops; a seed fixes a sampled answer;
    response_format is honoured; logprobs are the model's; what it cannot honour is refused; a dict output
    streams what it returns."""
    served, local = smollm
    sdk = client(served)
    for cap in ({"max_tokens": 8}, {"max_completion_tokens": 5}):
        capped = sdk.chat.completions.create(model="chat", messages=POEM, **cap)  # type: ignore[call-overload]
        assert capped.choices[0].finish_reason == "length"
        assert capped.usage is not None and capped.usage.completion_tokens == next(iter(cap.values()))
        # The prompt the model evaluated, chat template and system prompt included, by its own tokenizer.
        assert capped.usage.prompt_tokens == len(local.tokens(local.messages(POEM[0]["content"]))) > 20
    whole = sdk.chat.completions.create(model="chat", messages=POEM)  # type: ignore[arg-type]
    text = whole.choices[0].message.content or ""
    word = text.split()[3]
    stopped = sdk.chat.completions.create(model="chat", messages=POEM, stop=[word])  # type: ignore[arg-type]
    assert stopped.choices[0].message.content == text[: text.index(word)].strip()
    assert stopped.choices[0].finish_reason == "stop"
    sampled = [sdk.chat.completions.create(model="chat", messages=POEM, seed=seed, temperature=1.0,  # type: ignore[arg-type]
                                           max_tokens=24).choices[0].message.content for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    person = sdk.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Give a person's name and age as JSON."}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})  # type: ignore[arg-type]
    parsed = json.loads(person.choices[0].message.content or "")
    assert isinstance(parsed["name"], str) and isinstance(parsed["age"], int)
    scored = sdk.chat.completions.create(model="chat", messages=POEM, logprobs=True, top_logprobs=2,  # type: ignore[arg-type]
                                         max_tokens=6)
    assert scored.choices[0].logprobs is not None and scored.choices[0].logprobs.content is not None
    entries = scored.choices[0].logprobs.content
    assert len(entries) == 6 and "".join(e.token for e in entries).strip() == scored.choices[0].message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob for e in entries)
    hi = [{"role": "user", "content": "Say hi."}]
    natural = sdk.chat.completions.create(model="chat", messages=hi, max_tokens=40)  # type: ignore[arg-type]
    assert natural.choices[0].finish_reason == "stop" and natural.usage is not None and natural.usage.completion_tokens < 40
    forced = sdk.chat.completions.create(model="chat", messages=hi, max_tokens=40, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    assert forced.choices[0].finish_reason == "length" and forced.usage is not None and forced.usage.completion_tokens == 40
    with pytest.raises(openai.BadRequestError) as caught:  # what llama.cpp's generator does not honour: refused
        sdk.chat.completions.create(model="chat", messages=POEM, extra_body={"min_tokens": 4})  # type: ignore[arg-type]
    assert caught.value.body["param"] == "min_tokens"  # type: ignore[index]
    both = sdk.chat.completions.create(model="both", messages=POEM)  # type: ignore[arg-type]
    stream = sdk.chat.completions.create(model="both", messages=POEM, stream=True)  # type: ignore[arg-type]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == both.choices[0].message.content == text  # the answer's field alone, as it was returned


def test_an_openai_generator_passes_its_servers_usage_and_finish_reason_through() -> None:
    """Over a server that streams usage (patchkit's own chat route, over Words): the report is the server's."""
    from patchkit.components import OpenAIGenerator

    # The generator always sends its own temperature and seed, which Words does not take: that server drops them.
    with patchkit.deploy(draft_then_answer(), backend="inprocess", chat_output="answer",
                         chat_drop_params=["temperature", "seed"]) as served:
        remote = OpenAIGenerator(served.url + "/v1", model="patchkit", api_key="x", system_prompt=None)
        ensure_setup(remote)
        *chunks, report = OpenAIGenerator.generate.chunks(remote, ("q",), {"options": CallOptions(max_tokens=2)})
    assert "".join(c for c in chunks if isinstance(c, str)) == "q one"
    assert report == CallReport(6, 2, "length")  # Words' own counts, as the server sent them
