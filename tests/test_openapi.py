"""`GET /openapi.json`: the HTTP API as a valid OpenAPI 3.1 document, made from the routes a deployment serves and
the shapes of their bodies, guarded as the other routes are."""

from __future__ import annotations

import httpx
import pytest

import patchkit
from patchkit import Component, make
from patchkit.server.inputs import MAX_SLO_MS
from patchkit.server.openapi import ROUTE_DOCS, PipelineDoc, document

validator = pytest.importorskip("openapi_spec_validator", reason="the document is checked with openapi-spec-validator "
                                                                  "(the test extra)")


class Shelf(Component):
    @make(read_only=True)
    def find(self, title: str, limit: int) -> list[str]:
        return [title.upper()] * limit


shelf = Shelf()


def shelved(title: str = "dune", limit: int = 2) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:  # nothing runs here: deployed, it runs per request
        return shelf.find(title, limit)
    return pipeline


def test_the_document_of_every_documented_route_is_valid_openapi() -> None:
    made = document([(method, path, None) for method, path in ROUTE_DOCS], auth=True)
    validator.validate(made)
    assert made["openapi"].startswith("3.1")
    assert made["paths"]["/v1/stats"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Stats"}
    stats = made["components"]["schemas"]["Stats"]
    assert {"backend", "requests", "components"} <= set(stats["required"])
    assert made["components"]["schemas"]["ComponentStats"]["properties"]["state"]["enum"] == ["serving", "failed"]
    assert "security" not in made["paths"]["/readyz"]["get"] and made["paths"]["/v1/query"]["post"]["security"]
    query = made["components"]["schemas"]["QueryRequest"]  # of any pipeline: every constraint but its inputs'
    assert query["properties"]["slo_ms"]["exclusiveMinimum"] == 0 and query["additionalProperties"] is False
    assert set(query["properties"]) == {"inputs", "slo_ms", "stream", "steps", "options", "field"}
    chat = made["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat == {"$ref": "#/components/schemas/ChatRequest"}
    assert made["components"]["schemas"]["ChatRequest"]["required"] == ["messages"]


def test_a_deployment_serves_its_document_behind_its_token() -> None:
    with patchkit.deploy(shelved(), auth_token="s3cret") as endpoint:
        assert httpx.get(f"{endpoint.url}/openapi.json").status_code == 401
        reply = httpx.get(f"{endpoint.url}/openapi.json", headers={"Authorization": "Bearer s3cret"})
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("application/json")
        served = reply.json()
        assert endpoint.query(title="emma", limit=1) == ["EMMA"]
    validator.validate(served)
    for method, path in ROUTE_DOCS:  # every route of the API, each with what it answers
        if path != "/v1/chat/completions":  # two inputs and no chat_input: no chat request can be answered
            assert method.lower() in served["paths"][path], (method, path)
    assert "/v1/chat/completions" not in served["paths"]
    body = served["paths"]["/v1/query"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    inputs = body["properties"]["inputs"]
    assert inputs["properties"] == {"title": {"type": "string"}, "limit": {"type": "integer"}}
    assert sorted(inputs["required"]) == ["limit", "title"] and inputs["additionalProperties"] is False
    assert body["required"] == ["inputs"] and body["additionalProperties"] is False
    assert served["paths"]["/v1/pipelines/{name}/query"]["post"]["parameters"][0]["name"] == "name"
    own = served["paths"]["/v1/pipelines/patchkit/query"]["post"]
    assert own["requestBody"] == served["paths"]["/v1/query"]["post"]["requestBody"]
    for route in ("/v1/query", "/v1/pipelines/{name}/query", "/v1/stats", "/dashboard/{file}"):
        [operation] = served["paths"][route].values()
        assert "401" in operation["responses"], route  # with the token set, even a dashboard file's path names none


def test_a_route_the_docs_do_not_describe_is_listed_with_its_handler_docstring() -> None:
    async def mine() -> None:
        """My own page."""

    made = document([("GET", "/mine", mine), ("HEAD", "/mine", mine)])
    validator.validate(made)
    [operation] = made["paths"]["/mine"].values()
    assert operation["summary"] == "My own page." and set(operation["responses"]) == {"200", "400", "503"}


NOTES = PipelineDoc({"type": "object", "properties": {"question": {"type": "string"}}, "required": ["question"],
                     "additionalProperties": False})
LEDGER = PipelineDoc({"type": "object", "properties": {"amounts": {"type": "array"}}, "required": ["amounts"],
                      "additionalProperties": False}, fields=("total", "lines"), honoured=frozenset({"max_tokens"}))


def test_each_pipeline_served_has_its_own_query_path_with_its_inputs() -> None:
    made = document([(method, path, None) for method, path in ROUTE_DOCS], pipelines={"notes": NOTES, "led ger": LEDGER})
    validator.validate(made)
    notes = made["paths"]["/v1/pipelines/notes/query"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    ledger = made["paths"]["/v1/pipelines/led%20ger/query"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert notes["properties"]["inputs"] == NOTES.inputs and ledger["properties"]["inputs"] == LEDGER.inputs
    assert ledger["properties"]["field"] == {"enum": ["total", "lines", None]}
    [honoured] = [s for s in ledger["properties"]["options"]["anyOf"] if s.get("type") == "object"]
    assert honoured["properties"]["max_tokens"] == {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}
    assert None in honoured["properties"]["temperature"]["enum"] and len(honoured["properties"]["temperature"]["enum"]) == 1
    slo = notes["properties"]["slo_ms"]
    assert slo["exclusiveMinimum"] == 0 and slo["maximum"] == MAX_SLO_MS
    assert notes["properties"]["steps"]["type"] == "boolean"
    # several pipelines: the routes of the only one would answer 400 naming them, so they are not listed
    assert not {"/v1/query", "/v1/graph", "/v1/graph.svg"} & set(made["paths"])
    assert "404" in made["paths"]["/v1/pipelines/{name}/query"]["post"]["responses"]


def test_the_query_routes_stream_named_events_of_named_schemas() -> None:
    made = document([("POST", "/v1/query", None)], pipelines={"notes": NOTES})
    validator.validate(made)
    ok = made["paths"]["/v1/query"]["post"]["responses"]["200"]
    for name in ("`event: step`", "`event: error`", "`event: end`", "unnamed events"):
        assert name in ok["description"]
    events = {branch["properties"]["event"]["const"]: branch["properties"]["data"]
              for branch in ok["content"]["text/event-stream"]["schema"]["oneOf"]}
    assert set(events) == {"message", "step", "error", "end"}
    assert events["step"]["contentSchema"] == {"$ref": "#/components/schemas/StreamStep"}
    assert events["end"]["contentSchema"] == {"$ref": "#/components/schemas/StreamEnd"}
    assert events["message"]["contentSchema"]["anyOf"] == [{"$ref": "#/components/schemas/StreamDelta"},
                                                           {"$ref": "#/components/schemas/QueryReply"}]
    schemas = made["components"]["schemas"]
    assert schemas["StreamEnd"]["properties"]["status"]["enum"] == ["ok", "error"]
    assert {"preview", "preview_truncated", "sensitive", "error"} <= set(schemas["StepEvent"]["properties"])
    assert schemas["StreamStep"]["properties"]["step"] == {"$ref": "#/components/schemas/StepEvent"}


def test_where_steps_are_off_the_body_can_only_say_false() -> None:
    off = PipelineDoc(NOTES.inputs, steps=False)
    made = document([("POST", "/v1/query", None)], pipelines={"notes": off})
    body = made["paths"]["/v1/query"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["steps"]["const"] is False and "off" in body["properties"]["steps"]["description"]


def test_every_body_route_lists_the_edge_refusals() -> None:
    made = document([(method, path, None) for method, path in ROUTE_DOCS], auth=True)
    for path in ("/v1/query", "/v1/pipelines/{name}/query", "/v1/chat/completions"):
        assert {"400", "401", "408", "413", "415", "503"} <= set(made["paths"][path]["post"]["responses"]), path
    dashboard = made["paths"]["/dashboard/{file}"]["get"]
    assert "404" in dashboard["responses"] and "security" not in dashboard
    assert dashboard["parameters"][0]["schema"] == {"enum": ["app.js", "style.css", "index.html"]}
    assert "404" in made["paths"]["/v1/pipelines/{name}/graph.svg"]["get"]["responses"]
    chat = made["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert chat == {"anyOf": [{"$ref": "#/components/schemas/OpenAIError"}, {"$ref": "#/components/schemas/ErrorReply"}]}
    for path, methods in made["paths"].items():  # every route takes the client's request id and answers with it
        for operation in methods.values():
            assert any(p["name"] == "X-Request-ID" and p["in"] == "header" for p in operation["parameters"]), path
            assert all(reply["headers"]["X-Request-ID"]["required"] for reply in operation["responses"].values())


def test_an_integer_is_what_json_schema_counts_as_one() -> None:
    from patchkit.core.options import CallOptions, OptionError
    from patchkit.errors import InputError
    from patchkit.server.inputs import InputSchema

    schema = InputSchema({"count": 1})
    assert schema.check({"count": 2.0}) == {"count": 2} and type(schema.check({"count": 2.0})["count"]) is int
    assert CallOptions.parse({"max_tokens": 3.0, "seed": 7.0}) == CallOptions(max_tokens=3, seed=7)
    with pytest.raises(InputError, match="'count' must be an integer"):
        schema.check({"count": 2.5})
    with pytest.raises(OptionError, match="max_tokens must be an integer"):
        CallOptions.parse({"max_tokens": 1.5})
