"""Secrets a component is given never show: every repr of a component, its spec and its methods masks
the arguments whose names say they are secrets, and `OpenAIGenerator` given no key reads
`OPENAI_API_KEY` where it runs, so that the key is not in what travels to its workers."""

from __future__ import annotations

import logging
from typing import Any

import cloudpickle
import pytest

import patchkit
from patchkit import make
from patchkit.components import OpenAIGenerator

KEY = "sk-proj-Zq8Xv2Lm4Nw6Pt0Rb3Yc5Hd7Jf9Kg1"


class Client(patchkit.Component):
    def __init__(self, url: str, token: str, *, max_tokens: int = 8, options: dict[str, Any] | None = None) -> None:
        self.url, self.token = url, token

    @make
    def ask(self, question: str) -> str:
        return question


def _shown(component: patchkit.Component) -> list[str]:
    return [repr(component), str(component), repr(component._patchkit_spec), component._patchkit_spec.describe(),
            repr(component.ask if isinstance(component, Client) else component.generate)]  # type: ignore[attr-defined]


def test_the_openai_key_is_masked_in_every_repr() -> None:
    llm = OpenAIGenerator("http://127.0.0.1:8080/v1", api_key=KEY, extra_body={"repeat_penalty": 1.0})
    for text in _shown(llm):
        assert KEY[:6] not in text and KEY[-6:] not in text, text
        assert "api_key='***'" in text and "'repeat_penalty': 1.0" in text, text


def test_secret_arguments_are_masked_by_name_positional_keyword_or_nested() -> None:
    client = Client("http://x", KEY, max_tokens=16, options={"clientSecret": KEY, "Authorization": f"Bearer {KEY}", "n": 1})
    for text in _shown(client):
        assert KEY[:6] not in text and KEY[-6:] not in text, text
    assert repr(client) == (
        "Client('http://x', '***', max_tokens=16, options={'clientSecret': '***', 'Authorizatio...)"
    )
    assert repr(Client("http://x", None)) == "Client('http://x', None)"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "secret"),
    [("api_key", True), ("OPENAI_API_KEY", True), ("apiKey", True), ("hf_token", True), ("auth_token", True),
     ("DB_PASSWORD", True), ("client_secret", True), ("credentials", True),
     ("max_tokens", False), ("tokenizer", False), ("topk", False), ("author", False), ("key", False)],
)
def test_which_names_are_secrets(name: str, secret: bool) -> None:
    from patchkit.core import secret_like

    assert secret_like(name) is secret


def test_a_log_line_naming_a_component_masks_its_secrets(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="patchkit.test"):
        logging.getLogger("patchkit.test").info("starting %s", OpenAIGenerator("http://127.0.0.1:8080/v1", api_key=KEY))
    assert "api_key='***'" in caplog.text and KEY[:6] not in caplog.text


def test_an_openai_generator_given_no_key_carries_none_to_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    llm = OpenAIGenerator("http://127.0.0.1:8080/v1")
    assert KEY.encode() not in cloudpickle.dumps(llm)  # what deploy() sends a worker: the spec
    assert KEY not in repr(llm) and KEY not in str(vars(llm))
