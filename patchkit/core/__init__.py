"""`Component` and `@make`, and the call hook their calls go through: the leaf every part of patchkit may import.

This package imports nothing from patchkit but the leaf `errors` module. `base` holds the class and the
decorator, `spec` how a component is rebuilt elsewhere and shown, `calls` a call's site and its hook,
`pending` a request's calls in flight (parallel calls), `event_loop` the loop async components run on.
"""

from patchkit.core.base import BoundMake, Component, MakeMethod, ensure_setup, make, make_methods, mark_served_elsewhere
from patchkit.core.calls import Call, CallHook, CallSite, active_call_hook, call_hook
from patchkit.core.spec import ComponentSpec, secret_like

__all__ = [
    "BoundMake",
    "Call",
    "CallHook",
    "CallSite",
    "Component",
    "ComponentSpec",
    "MakeMethod",
    "active_call_hook",
    "call_hook",
    "ensure_setup",
    "make",
    "make_methods",
    "mark_served_elsewhere",
    "secret_like",
]
