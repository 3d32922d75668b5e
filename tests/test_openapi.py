"""`GET /openapi.json`: the HTTP API as a valid OpenAPI 3.1 document, made from the routes a deployment serves and
the shapes of their bodies, guarded as the other routes are."""

from __future__ import annotations

import httpx
import pytest

import patchkit
from patchkit import Component, make
from patchkit.server.openapi import ROUTE_DOCS, document

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


def test_a_deployment_serves_its_document_behind_its_token() -> None:
    with patchkit.deploy(shelved(), auth_token="s3cret") as endpoint:
        assert httpx.get(f"{endpoint.url}/openapi.json").status_code == 401
        reply = httpx.get(f"{endpoint.url}/openapi.json", headers={"Authorization": "Bearer s3cret"})
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("application/json")
        served = reply.json()
        assert endpoint.query(title="emma", limit=1) == ["EMMA"]
    validator.validate(served)
    for method, path in ROUTE_DOCS:  # every route of the API, each with what it answers
        assert method.lower() in served["paths"][path], (method, path)
    body = served["paths"]["/v1/query"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    inputs = body["allOf"][1]["properties"]["inputs"]["properties"]
    assert inputs == {"title": {"type": "string"}, "limit": {"type": "integer"}}
    assert served["paths"]["/v1/pipelines/{name}/query"]["post"]["parameters"][0]["name"] == "name"


def test_a_route_the_docs_do_not_describe_is_listed_with_its_handler_docstring() -> None:
    async def dashboard() -> None:
        """The dashboard page."""

    made = document([("GET", "/dashboard", dashboard), ("HEAD", "/dashboard", dashboard)])
    validator.validate(made)
    [operation] = made["paths"]["/dashboard"].values()
    assert operation["summary"] == "The dashboard page." and set(operation["responses"]) == {"200", "503"}
