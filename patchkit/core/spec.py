"""`ComponentSpec`: what it takes to rebuild a component in another process, and how it is shown.

Made by `Component.__new__` for every component; travels to workers in its place (`Component.__reduce__`).
Its `describe()` is how graphs, plans and logs name a component, with secret-looking arguments masked.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from patchkit.core.component import Component

__all__ = ["MASK", "ComponentSpec", "secret_like"]


@dataclass(frozen=True)
class ComponentSpec:
    """What it takes to rebuild a component in another process: its class and constructor arguments.

    `uid` names the component across processes: a rebuilt component keeps the uid of the original. `digest`
    is its version (`patchkit.program.identity`), computed where the user's code is (`deploy()`, `update()`,
    the reloader, `plan()`) and travelling with it, so that a process that holds no user code (the
    front-end) compares versions without deriving them; "" until then.
    """

    cls: type[Component]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(hash=False)
    uid: str
    digest: str = field(default="", compare=False)

    def build(self) -> Component:
        """Construct a fresh component; called by a worker process before it runs `setup()`."""
        component = self.cls(*self.args, **self.kwargs)
        component.__dict__["_patchkit_spec"] = self
        return component

    def parameter_names(self) -> list[str]:
        """The names of the constructor's parameters the positional `args` fill ('' where it cannot name one)."""
        return _parameter_names(self.cls, len(self.args))

    def describe(self) -> str:
        """`Cls(arg, key=value)` with short reprs, for graphs, plans and logs; secrets masked (`secret_like`)."""
        names = self.parameter_names()
        parts = [_short_repr(_masked(name, a)) for name, a in zip(names, self.args, strict=True)]
        parts += [f"{k}={_short_repr(_masked(k, v))}" for k, v in self.kwargs.items()]
        return f"{self.cls.__name__}({', '.join(parts)})"

    def __repr__(self) -> str:
        # Not the dataclass's: that would print every argument, secrets included, in full.
        return f"ComponentSpec({self.describe()}, uid={self.uid!r})"


# An argument whose name has one of these words (in any case: api_key, hf_token, clientSecret, DB_PASSWORD) is
# shown as MASK in every repr and log. Words, not substrings: max_tokens and tokenizer are no secrets.
SECRET_WORDS = frozenset({"apikey", "token", "password", "passwd", "secret", "secrets", "authorization", "credential",
                          "credentials"})
MASK = "***"


def secret_like(name: object) -> bool:
    """Whether an argument (or a dict key) of this name holds a secret: an API key, a token, a password."""
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name)).lower()  # camelCase -> camel_case
    words = [word for word in re.split(r"[^a-z0-9]+", text) if word]
    pairs = {a + b for a, b in zip(words, words[1:])}  # api_key -> apikey
    return bool(SECRET_WORDS.intersection(words) or "apikey" in pairs)


def _masked(name: object, value: Any) -> Any:
    """`value` for display: MASK if `name` looks secret; a dict with its secret-looking keys masked, at any depth."""
    if value is None:
        return None
    if secret_like(name):
        return MASK
    if isinstance(value, dict):
        return {k: _masked(k, v) for k, v in value.items()}
    return value


def _parameter_names(cls: type, count: int) -> list[str]:
    """The names of the first `count` positional parameters of `cls.__init__`, so that a secret passed
    positionally is masked too; '' for one it cannot name (*args)."""
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (names + [""] * count)[:count]


def _short_repr(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
