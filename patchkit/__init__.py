"""patchkit: serve RAG pipelines written in plain Python.

Mark component methods with `@patchkit.make`, write the pipeline inside
`with patchkit.capture() as pipeline:`, and run it again with `pipeline(**inputs)`.

The package map, the one-way imports between packages and one request's path from `deploy()` to a
worker and back are drawn in `docs/architecture.md`.
"""

from patchkit import capture as _capture_package  # noqa: F401 - load the package before the function shadows its name
from patchkit.capture.graph import Graph
from patchkit.client.capture import capture
from patchkit.client.deploy import deploy
from patchkit.client.endpoint import Endpoint
from patchkit.client.pipeline_client import PipelineClient
from patchkit.client.planning import plan
from patchkit.client.streams import AsyncStream, Stream
from patchkit.core import Component, make
from patchkit.errors import (
    CallError,
    CaptureError,
    ComponentError,
    ComponentFailed,
    ConfigError,
    DeadlineExceeded,
    InputError,
    MakeError,
    Overloaded,
    PatchkitError,
    PipelineNotFound,
    PlanError,
    WorkerDiedError,
)
from patchkit.program.pipeline import Pipeline, last_pipeline
from patchkit.scheduler.offline.plan import Plan

__version__ = "0.1.0"

__all__ = [
    "AsyncStream",
    "CallError",
    "CaptureError",
    "Component",
    "ComponentError",
    "ComponentFailed",
    "ConfigError",
    "DeadlineExceeded",
    "Endpoint",
    "Graph",
    "InputError",
    "MakeError",
    "Overloaded",
    "PatchkitError",
    "Pipeline",
    "PipelineClient",
    "PipelineNotFound",
    "Plan",
    "PlanError",
    "Stream",
    "WorkerDiedError",
    "capture",
    "deploy",
    "last_pipeline",
    "make",
    "plan",
]
