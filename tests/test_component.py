"""Component records its arguments, @make checks its target, calls run locally outside capture."""

from __future__ import annotations

import pickle
import threading
from collections.abc import AsyncIterator

import cloudpickle
import pytest
from components import Generator, Retriever

import patchkit
from patchkit import Component, MakeError, make


def test_constructor_arguments_are_recorded_without_help() -> None:
    gen = Generator(prefix="Z")
    spec = gen._patchkit_spec
    assert (spec.cls, spec.args, spec.kwargs) == (Generator, (), {"prefix": "Z"})
    assert repr(gen) == "Generator(prefix='Z')"


def test_rebuilt_component_has_fresh_state_and_same_identity() -> None:
    retriever = Retriever(topk=1)
    assert retriever.retrieve("exception") == ["Use try and except to catch an exception."]
    assert retriever.loads == 1
    copy = pickle.loads(cloudpickle.dumps(retriever))
    assert copy.topk == 1 and copy.loads == 0 and not hasattr(copy, "index")  # loaded state never travels
    assert copy._patchkit_spec.uid == retriever._patchkit_spec.uid


def test_setup_runs_once_lazily() -> None:
    retriever = Retriever()
    assert retriever.loads == 0
    retriever.retrieve("loops")
    retriever.retrieve("generators")
    assert retriever.loads == 1


def test_setup_called_by_hand_is_not_run_again_by_the_first_call() -> None:
    retriever = Retriever()
    retriever.setup()
    retriever.setup()
    retriever.retrieve("loops")
    assert retriever.loads == 1


class _Base(Component):
    def __init__(self) -> None:
        self.log: list[str] = []
        self.fail = False

    def setup(self) -> None:
        self.log.append("base")

    @make
    def echo(self, x: str) -> str:
        return x


class _Derived(_Base):
    def setup(self) -> None:
        super().setup()
        if self.fail:
            raise RuntimeError("no model")
        self.log.append("derived " + self.echo("warm"))  # a call of its own while it sets up


def test_setup_chain_runs_each_part_once_and_a_failed_setup_is_tried_again() -> None:
    part = _Derived()
    part.fail = True
    with pytest.raises(RuntimeError, match="no model"):
        part.echo("x")
    part.fail = False
    threads = [threading.Thread(target=part.echo, args=("x",)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    part.setup()
    assert part.log == ["base", "base", "derived warm"]


def test_batch_method_is_called_with_one_item_and_batches_underneath() -> None:
    gen = Generator()
    assert gen.rewrite("How do I loop") == "how to loop python"
    assert Generator.rewrite.run_batch(gen, [(("a",), {}), ((), {"query": "b"})]) == ["a python", "b python"]


def test_make_bare_and_with_options() -> None:
    class Both(Component):
        @make
        def one(self, x: int) -> int:
            return x + 1

        @make()
        def two(self, x: int) -> int:
            return x + 2

    assert Both().one(1) == 2 and Both().two(1) == 3


def test_make_on_plain_function_is_rejected_when_applied() -> None:
    def helper(x: int) -> int:
        return x

    with pytest.raises(MakeError, match="helper: it is a plain function"):
        make(helper)


def test_make_on_non_component_class_names_the_method() -> None:
    with pytest.raises((MakeError, RuntimeError)) as info:

        class NotAComponent:
            @make
            def run(self, x: int) -> int:
                return x

    error = info.value if isinstance(info.value, MakeError) else info.value.__cause__
    assert isinstance(error, MakeError)
    assert "NotAComponent.run" in str(error) and "patchkit.Component" in str(error)


def test_make_rejects_static_unstreamed_generators_and_star_args_batches() -> None:
    with pytest.raises(MakeError, match="staticmethod"):
        make(staticmethod(lambda x: x))
    with pytest.raises(MakeError, match="a method yielding text chunks takes @make\\(stream=True\\)"):

        class Yielding(Component):
            @make
            async def run(self, x: int) -> AsyncIterator[int]:
                yield x

    with pytest.raises(MakeError, match="cannot be batched"):

        class Star(Component):
            @make(batch=True)
            def run(self, *xs: int) -> list[int]:
                return list(xs)

    with pytest.raises(MakeError, match="keyword options only"):
        make(3)


def test_batch_method_returning_wrong_length_names_the_method() -> None:
    class Short(Component):
        @make(batch=True)
        def run(self, x: list[int]) -> list[int]:
            return []

    with pytest.raises(MakeError, match=r"Short.run is @make\(batch=True\).*1 here; it returned 0 results"):
        Short().run(1)


def test_batch_call_with_wrong_arguments_is_a_type_error_naming_the_method() -> None:
    with pytest.raises(TypeError, match="Generator.rewrite"):
        Generator().rewrite("a", "b")


def test_public_names() -> None:
    assert sorted(patchkit.__all__) == [
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
    assert all(hasattr(patchkit, name) for name in patchkit.__all__)
    # `patchkit.capture` stays the function users call, though importing the subpackage patchkit/capture/
    # binds the same name on the package
    gen = Generator()
    with patchkit.capture(run=False) as pipeline:
        out = gen.generate("q")  # noqa: F841 - the block's output
    assert isinstance(pipeline, patchkit.Pipeline) and list(pipeline.components) == ["gen"]
