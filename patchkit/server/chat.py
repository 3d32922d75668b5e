"""The OpenAI chat API over the pipelines, a model per pipeline, for chat UIs, SDKs and evaluation tools.

    GET  /v1/models             a model per pipeline, by its name (one pipeline deployed alone: the
                                deployment's `chat_name`)
    POST /v1/chat/completions   `model` names the pipeline (it may be left out where one is served);
                                a pipeline with a `messages` input gets the whole conversation there,
                                each message as the client sent it; the last user message fills its
                                text input (its one other input, else `chat_input`). The output is the
                                assistant's message: a str output, or the `chat_output` field of a dict
                                output. `stream: true` answers `chat.completion.chunk` events (the role,
                                content deltas of the call that makes that text, a last chunk with its
                                finish_reason, with `stream_options.include_usage` a usage chunk) then
                                `data: [DONE]`.

Nothing a request says is dropped unsaid. Every other field of the request fills the pipeline's input of
its name where the pipeline declares one (`tools`, `temperature`, `seed`, ...). A sampling option
(`core.options.OPTIONS`, `max_completion_tokens` as `max_tokens`) that fills no input reaches the call that
answers (the generator call whose text is the reply, the call the stream follows) as its `CallOptions`,
where that call honours it (`honoured_options`); every other call keeps its own settings. Anything else is
refused (400, `param` naming it), but for the fields a deployment lists in `chat_drop_params` (accepted
and ignored, logged once each) and those that ask for no change in the answer (`ROUTING_FIELDS`).
`usage` is the answering call's own count (its `CallReport`): the prompt it evaluated and the tokens it
made; where no call reported one it is an estimate (about four characters a token), marked
`"estimated": true`. Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from patchkit.core.options import NEEDS_LOGPROBS, OPTIONS, CallOptions, CallReport, OptionError, option_schema
from patchkit.errors import InputError
from patchkit.server.events import EventStream, pump
from patchkit.server.inputs import InputSchema, coerce, parse_json
from patchkit.server.replies import REQUEST_ID_HEADER, error_reply, json_reply, request_id_of
from patchkit.serving.frontend import Frontend, Version

__all__ = ["MESSAGES_INPUT", "ROUTING_FIELDS", "TOOL_FIELDS", "ChatRoutes", "estimate_tokens"]

logger = logging.getLogger(__name__)

# The input a pipeline declares to get the whole conversation (a list of message dicts, as sent).
MESSAGES_INPUT = "messages"
# Request fields that change what the model may answer (tool calls): each reaches the pipeline's input of
# the same name, and a request carrying one the pipeline has no input for is refused, never ignored.
TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call")
# Fields that route the request or ask for no change in its answer: read here, or accepted as they are
# (`user` fills a `user` input where the pipeline declares one).
ROUTING_FIELDS = ("model", "messages", "stream", "stream_options", "n", "user", "metadata", "store", "service_tier")
# OpenAI's newer name for max_tokens: where both are given, it wins, as at OpenAI.
MAX_COMPLETION_TOKENS = "max_completion_tokens"
# OpenAI's error types, by status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                503: "overloaded_error", 504: "timeout_error"}
ReadBody = Callable[[web.Request, Callable[[bytes], Awaitable[web.StreamResponse]]], Awaitable[web.StreamResponse]]


class ChatError(InputError):
    """A chat request the route refuses, with OpenAI's `param` and `code` and its status."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def estimate_tokens(text: str) -> int:
    """About four characters a token: the usage figures where no call counted them (marked estimated)."""
    return math.ceil(len(text) / 4)


class ChatRoutes:
    """The routes, over one front-end; `read_body` is the edge's bounded body reader (http.py)."""

    def __init__(self, frontend: Frontend, read_body: ReadBody) -> None:
        self.frontend = frontend
        self.config = frontend.config
        self.read_body = read_body
        self._dropped: set[str] = set()  # the chat_drop_params fields logged once already

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.models)
        router.add_post("/v1/chat/completions", self.completions)

    async def models(self, request: web.Request) -> web.Response:
        """A model per pipeline served, by its name."""
        created = int(self.frontend.collector.started)
        models = [{"id": name, "object": "model", "created": created, "owned_by": "patchkit"} for name in self.frontend.versions]
        return json_reply(200, {"object": "list", "data": models})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        async def run(body: bytes) -> web.StreamResponse:
            chat, version, inputs, options = self._parse(body)
            completion = _Completion(self, request, chat, version, inputs, options)
            return await (completion.stream() if chat.get("stream") else completion.whole())

        return await self.read_body(request, self._openai_errors(request, run))

    def _openai_errors(self, request: web.Request, run: Callable[[bytes], Awaitable[web.StreamResponse]]) -> Callable[
            [bytes], Awaitable[web.StreamResponse]]:
        """`run`, its errors answered in OpenAI's form (the edge's own, such as 413, keep patchkit's)."""
        async def guarded(body: bytes) -> web.StreamResponse:
            try:
                return await run(body)
            except (web.HTTPException, ConnectionResetError):
                raise
            except ChatError as exc:
                return self._error_reply(request, exc.status, str(exc), exc.param, exc.code)
            except Exception as exc:
                status, payload = error_reply(exc, debug=self.config.server.debug)
                code = None if status == 400 else payload["error"]["type"]  # OpenAI's codes, never patchkit's class names
                return self._error_reply(request, status, payload["error"]["message"], None, code)
        return guarded

    def _error_reply(self, request: web.Request, status: int, message: str, param: str | None, code: str | None) -> web.Response:
        if status < 500:
            logger.warning("POST %s: %d %s", request.rel_url.raw_path, status, " ".join(message.split()))
        return json_reply(status, openai_error(status, message, param, code), {REQUEST_ID_HEADER: request_id_of(request)})

    def _parse(self, body: bytes) -> tuple[dict[str, Any], Version, dict[str, Any], CallOptions | None]:
        """The request, checked: a JSON object with `messages`, a model served, one choice; with the version of
        the model's pipeline that serves it, the inputs the request fills (`_chat_inputs`) and the options for
        the call that answers (`_options`)."""
        chat = parse_json(body)
        if not isinstance(chat, dict):
            raise ChatError('the body must be a JSON object: {"model": ..., "messages": [...]}')
        version = self._version(chat.get("model"))
        if chat.get("n", 1) not in (1, None) or isinstance(chat.get("n"), bool):
            raise ChatError("n must be 1: the pipeline answers once", param="n")
        if not isinstance(chat.get("stream", False), (bool, type(None))):
            raise ChatError("stream must be true or false", param="stream")
        inputs = version.pipeline.inputs
        filled = self._chat_inputs(chat, inputs)
        options = self._options(chat, inputs, filled, version)
        return chat, version, filled, options

    def body_schema(self, name: str, version: Version, several: bool) -> dict[str, Any] | None:
        """The JSON Schema of the chat requests model `name` (served by `version`) answers, as `_parse` checks
        them; None where it answers none (several inputs and no chat_input, a dict output and no chat_output).

        Called by `GET /openapi.json`; `several`: other pipelines are served too, so `model` is required."""
        inputs = version.pipeline.inputs
        chat_input = self._chat_input(inputs)
        fields = version.pipeline.graph.output_fields
        if (chat_input is None and MESSAGES_INPUT not in inputs) or (fields and self.config.chat.output is None):
            return None
        if chat_input is not None and not isinstance(inputs[chat_input], (str, type(None))):
            return None  # the last user message's text cannot fill it
        message = {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string"}, "content": {"type": ["string", "array", "null"]}}}
        messages: dict[str, Any] = {"type": "array", "minItems": 1, "items": message}
        if chat_input is not None:  # the last user message fills it
            messages["contains"] = {"properties": {"role": {"const": "user"}}}
        properties: dict[str, Any] = {
            "model": {"const": name} if several else {"enum": [name, None]}, "messages": messages,
            "stream": {"type": ["boolean", "null"]}, "n": {"enum": [1, None]},
            **{field: {} for field in ROUTING_FIELDS if field not in ("model", "messages", "stream", "n")},
            **self._field_schemas(inputs, version.runner.honoured(self.config.chat.output)),
        }
        older = {} if "max_tokens" in inputs else {  # max_completion_tokens given, max_tokens is not read
            "if": {"required": [MAX_COMPLETION_TOKENS], "properties": {MAX_COMPLETION_TOKENS: {"not": {"type": "null"}}}},
            "then": {"properties": {"max_tokens": True}}, "else": {"properties": {"max_tokens": properties["max_tokens"]}}}
        if older:
            properties["max_tokens"] = {}
        required = ["model", "messages"] if several else ["messages"]
        return {"type": "object", "required": required, "properties": properties, "additionalProperties": False,
                "allOf": [NEEDS_LOGPROBS, *([older] if older else [])]}

    def _field_schemas(self, inputs: Mapping[str, Any], honoured: frozenset[str]) -> dict[str, Any]:
        """The chat body's other fields, as `_options` reads them: the sampling options (any value its check takes
        where honoured, else null), the fields that fill inputs (typed by the input, and checked as the option
        of their name too), `chat_drop_params`, and the field of chat_input's name (ignored)."""
        schemas: dict[str, Any] = {field: {} for field in self.config.chat.drop_params}
        schemas.update({option: _given_option(option, honoured) for option in OPTIONS})
        schemas[MAX_COMPLETION_TOKENS] = _given_option("max_tokens", honoured)
        typed = InputSchema(inputs).json_schema()["properties"]
        for name in inputs:
            if name not in (MESSAGES_INPUT, self.config.chat.input) and name in typed:
                schemas[name] = {"anyOf": [typed[name], {"type": "null"}]}
        for name in list(schemas):
            checked = name not in ROUTING_FIELDS and name not in TOOL_FIELDS
            if checked and _option(name) in OPTIONS and (name in inputs or name in self.config.chat.drop_params):
                schemas[name] = {"allOf": [schemas[name], option_schema(_option(name))]}  # `CallOptions.parse` checks it
            if name in TOOL_FIELDS and name not in inputs:
                del schemas[name]
        if "tools" in inputs and "tool_choice" not in inputs:
            schemas["tool_choice"] = {"enum": ["auto", None]}  # OpenAI's default where tools are given
        if self.config.chat.input is not None:
            schemas[self.config.chat.input] = {}  # the last user message fills it, whatever the request says
        return schemas

    def _chat_input(self, inputs: Mapping[str, Any]) -> str | None:
        """The input the last user message fills: `chat_input`, else a pipeline's one other input."""
        taken = (MESSAGES_INPUT, *TOOL_FIELDS, *ROUTING_FIELDS)  # inputs a request field of their name fills
        others = [name for name in inputs if name not in taken and _option(name) not in OPTIONS]
        chat_input = self.config.chat.input if self.config.chat.input in inputs else None
        return chat_input or (others[0] if len(others) == 1 and MESSAGES_INPUT not in inputs else None)

    def _chat_inputs(self, chat: dict[str, Any], inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The pipeline inputs a chat request fills: `messages` (the whole conversation) where the pipeline
        declares it, the text input (the last user message), and the tool fields it declares."""
        messages = _checked_messages(chat.get("messages"))
        filled: dict[str, Any] = {name: chat[name] for name in _tool_fields(chat, inputs)}
        if MESSAGES_INPUT in inputs:
            filled[MESSAGES_INPUT] = messages
        chat_input = self._chat_input(inputs)
        if chat_input is not None:
            filled[chat_input] = _last_user_text(messages)
        elif MESSAGES_INPUT not in inputs:
            raise ChatError(f"the pipeline has inputs {', '.join(sorted(inputs))}: deploy it with chat_input= naming the "
                            f"one the last user message fills, or give it a {MESSAGES_INPUT!r} input for the whole "
                            "conversation")
        return filled

    def _options(self, chat: dict[str, Any], inputs: Mapping[str, Any], filled: dict[str, Any],
                 version: Version) -> CallOptions | None:
        """Fill `filled` with the inputs the request's other fields name, and return the sampling options for
        the call that answers (None: none given).

        Raises:
            ChatError: an option out of range, or a field neither an input nor honoured (nor dropped).
        """
        fields = {name: value for name, value in chat.items() if value is not None and name not in TOOL_FIELDS
                  and name not in (MESSAGES_INPUT, self.config.chat.input) and (name not in ROUTING_FIELDS or name in inputs)}
        if MAX_COMPLETION_TOKENS in fields and "max_tokens" not in inputs:
            fields.pop("max_tokens", None)  # its older name: the newer one wins, as at OpenAI
        try:  # every option checked as OpenAI checks it, whoever takes it
            CallOptions.parse({_option(name): value for name, value in fields.items()})
        except OptionError as exc:
            param = MAX_COMPLETION_TOKENS if exc.param == "max_tokens" and MAX_COMPLETION_TOKENS in fields else exc.param
            raise ChatError(str(exc), param=param) from None
        honoured = version.runner.honoured(self.config.chat.output)
        options: dict[str, Any] = {}
        for name, value in fields.items():
            if name in inputs:
                try:
                    filled[name] = coerce(name, value, inputs[name])
                except InputError as exc:
                    raise ChatError(str(exc), param=name) from None
            elif _option(name) in OPTIONS and _option(name) in honoured:
                options[_option(name)] = value
            elif name in self.config.chat.drop_params:
                self._drop(name)
            else:
                raise self._refusal(name, _option(name) in OPTIONS, honoured)
        return CallOptions.parse(options) if options else None

    def _refusal(self, name: str, is_option: bool, honoured: frozenset[str]) -> ChatError:
        """The 400 for a field neither an input nor honoured."""
        if is_option:
            why = (f"the call that answers honours only {', '.join(sorted(honoured))}" if honoured else
                   "no call that answers this pipeline takes sampling options (a built-in generator's does)")
        else:
            why = "it is not an option patchkit's generators honour"
        return ChatError(f"{name} was given, but the pipeline declares no {name!r} input and {why}: it cannot honour it; "
                         f"leave {name} out, give the pipeline a {name!r} input, or list it in chat_drop_params",
                         param=name, code="unsupported_parameter")

    def _drop(self, name: str) -> None:
        if name not in self._dropped:
            self._dropped.add(name)
            logger.warning("chat requests' %r is accepted and ignored (chat_drop_params): the pipeline neither takes "
                           "nor honours it", name)

    def _version(self, model: object) -> Version:
        """The version serving `model`'s pipeline; no model: the only pipeline's."""
        served = ", ".join(repr(name) for name in self.frontend.versions)
        if model is not None and not isinstance(model, str):
            raise ChatError(f"model must be the name of a model (GET /v1/models): {served}", param="model")
        if model is not None and model not in self.frontend.versions:
            raise ChatError(f"the model {model!r} does not exist: this endpoint serves {served} (GET /v1/models)",
                            status=404, param="model", code="model_not_found")
        if model is None and len(self.frontend.versions) != 1:
            raise ChatError(f"this endpoint serves a model per pipeline ({served}): name one as model", param="model")
        return self.frontend.route(model if isinstance(model, str) else None)


class _Completion:
    """One chat completion: the pipeline run on the conversation (its inputs filled by the request), answered
    whole or as chunks."""

    def __init__(self, routes: ChatRoutes, request: web.Request, chat: dict[str, Any], version: Version,
                 inputs: dict[str, Any], options: CallOptions | None) -> None:
        self.routes, self.request, self.chat = routes, request, chat
        self.version, self.inputs, self.options = version, inputs, options
        self.request_id = request_id_of(request)
        self.created = int(time.time())
        self.prompt_text = " ".join(_text(m.get("content")) for m in chat["messages"] if isinstance(m, dict))

    def _query(self, on_delta: Callable[[str], object] | None = None) -> Awaitable[Any]:
        return self.version.runner.query(self.inputs, request_id=self.request_id, on_delta=on_delta, options=self.options,
                                         field=self.routes.config.chat.output)

    def _answer(self, output: Any) -> str:
        """The assistant's message in the pipeline's output."""
        field = self.routes.config.chat.output
        if isinstance(output, dict):
            if field is None:
                raise ChatError(f"the pipeline's output is a dict (fields {', '.join(sorted(map(str, output)))}): deploy "
                                "it with chat_output= naming the field that holds the answer", param="chat_output")
            if field not in output:
                raise ChatError(f"the pipeline's output has no field {field!r} (chat_output)", status=500)
            output = output[field]
        return str(output) if isinstance(output, str) else json.dumps(output)

    def _usage(self, answer: str, report: CallReport | None) -> dict[str, Any]:
        """The answering call's token counts; an estimate, marked so, where it reported none."""
        if report is not None and report.counted:
            prompt, completion = report.prompt_tokens, report.completion_tokens
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        prompt, completion = estimate_tokens(self.prompt_text), estimate_tokens(answer)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "estimated": True}

    def _logprobs(self, report: CallReport | None) -> dict[str, Any] | None:
        if self.options is None or not self.options.logprobs or report is None or report.logprobs is None:
            return None
        return {"content": report.logprobs}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{self.request_id}", "object": kind, "created": self.created, "model": self.version.name}

    async def whole(self) -> web.Response:
        result = await self._query()
        answer, report = self._answer(result.output), result.report
        choice = {"index": 0, "message": {"role": "assistant", "content": answer}, "logprobs": self._logprobs(report),
                  "finish_reason": report.finish_reason if report is not None else "stop"}
        reply = {**self._head("chat.completion"), "choices": [choice], "usage": self._usage(answer, report)}
        return json_reply(200, reply, {REQUEST_ID_HEADER: self.request_id})

    async def stream(self) -> web.StreamResponse:
        """Chunks as the answering call makes the reply's text: the role with the first, the rest of the answer
        (what the deltas did not carry, all of it when nothing streamed) before the last."""
        events = EventStream(self.request, {REQUEST_ID_HEADER: self.request_id})
        sent: list[str] = []

        async def send(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
            if not events.started:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": extra.pop("logprobs", None)}
            await events.send(json.dumps({**self._head("chat.completion.chunk"), "choices": [choice], **extra}).encode())

        async def on_delta(text: str) -> None:
            sent.append(text)
            await send({"content": text})

        try:
            result = await pump(self._query, on_delta)
            answer, report = self._answer(result.output), result.report
        except (ConnectionResetError, web.HTTPException):
            raise
        except Exception as exc:
            if not events.started:
                raise
            status, payload = error_reply(exc, debug=self.routes.config.server.debug)
            error = openai_error(status, payload["error"]["message"], None, payload["error"]["type"])
            await events.send(json.dumps(error).encode())
            return await events.finish()
        streamed = "".join(sent)
        if answer.startswith(streamed) and len(answer) > len(streamed):
            await send({"content": answer[len(streamed):]})
        await send({}, report.finish_reason if report is not None else "stop", logprobs=self._logprobs(report))
        options = self.chat.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await events.send(json.dumps({**self._head("chat.completion.chunk"), "choices": [],
                                          "usage": self._usage(answer, report)}).encode())
        await events.send(b"[DONE]")
        return await events.finish()


def _given_option(name: str, honoured: frozenset[str]) -> dict[str, Any]:
    """A sampling option's field in a chat body: any value its check takes where honoured, else only null (any
    other value is refused, even its default)."""
    return option_schema(name) if name in honoured else {"type": "null", "description": "not honoured by the call that answers"}


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _option(field: str) -> str:
    """The `CallOptions` name of a request field: max_completion_tokens is max_tokens."""
    return "max_tokens" if field == MAX_COMPLETION_TOKENS else field


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    return ""


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's `messages`, checked to be a non-empty list of objects with a role and text content."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects", param="messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatError("each message must be an object with a role and content", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ChatError("a message's content must be a string or a list of content parts", param="messages")
    return messages


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise ChatError("messages has no user message: the last one is the pipeline's input", param="messages")
    return _text(users[-1].get("content"))


def _tool_fields(chat: dict[str, Any], inputs: Mapping[str, Any]) -> list[str]:
    """The tool fields the request carries (None counts as absent), each checked to have its pipeline input.

    `tool_choice: "auto"` is OpenAI's default where tools are given: it needs only the `tools` input.

    Raises:
        ChatError: the first field the pipeline has no input for (400, `param` naming it).
    """
    given = [name for name in TOOL_FIELDS if chat.get(name) is not None]
    for name in given:
        if name in inputs or (name == "tool_choice" and chat[name] == "auto" and "tools" in inputs):
            continue
        if "tools" not in inputs:
            why = "this pipeline takes no tools (it declares no 'tools' input)"
        else:
            why = f"this pipeline declares no {name!r} input"
        raise ChatError(f"{name} was given, but {why}: it cannot honour it; leave {name} out, or give the pipeline "
                        f"a {name!r} input", param=name, code="unsupported_parameter")
    return [name for name in given if name in inputs]
