"""The OpenAI chat API over a deployed pipeline, with the `openai` SDK as the client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from components import Generator

import patchkit
from patchkit import Component, make
from patchkit.errors import ConfigError

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


def client(endpoint: patchkit.Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.url + "/v1", api_key="x", max_retries=0)


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
