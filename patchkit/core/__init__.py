"""`Component` and `@make`, and the call hook their calls go through: the leaf every part of patchkit may import.

This package imports nothing from patchkit but the leaves `errors` and `envs`. `component` and `make` hold the
class and the decorator, `spec` how a component is rebuilt elsewhere and shown, `calls` a call's site and its hook,
`event_loop` the loop async components run on. A request's calls in flight (parallel calls) are the capture's
runtime (`patchkit.capture.pending`); a component's identity is the program's (`patchkit.program.identity`); how an
engine that batches by itself splits a turn sits beside the llama.cpp engine (`engine_turn`).
"""

from patchkit.core.calls import Call, CallHook, CallSite, active_call_hook, call_hook
from patchkit.core.component import Component, ensure_setup, is_set_up, mark_served_elsewhere, release_setup
from patchkit.core.make import BoundMake, MakeMethod, make, make_methods
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
    "is_set_up",
    "make",
    "make_methods",
    "mark_served_elsewhere",
    "release_setup",
    "secret_like",
]
