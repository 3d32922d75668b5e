"""The pipelines of the throughput benchmark, each written three ways over one set of components.

A `Workload` builds its components (fresh objects of the same classes with the same arguments, so
every system runs the very same code) and offers:

- `capture(components)`: the pipeline as patchkit captures it (what `deploy()` serves);
- `sequential(components, inputs)`: the same steps as plain Python, start to end, one request at a
  time: the code an author's reference server runs per request;
- `graph(components)`: the same steps as a LangGraph `StateGraph` with conditional edges.

All three return the same output for the same inputs (`tests/test_baselines.py` checks it).

Shapes: CRAG (retrieve, grade; on a failed grade rewrite and search elsewhere; generate) and IRCoT
(retrieve, then think and retrieve again until a thought gives the answer). Simulated components
follow the latency curves the papers measure (a Qdrant-like retriever whose cost grows with the
batch, a Chroma-like one that batches well, a vLLM-like generator whose batch time is flat, a
llama.cpp-like one that does not batch); the real ones are MiniLM + FAISS and SmolLM2 on llama.cpp.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import patchkit
from patchkit import Component
from patchkit.components import merge_hits, sources
from patchkit.components.testing import Simulated

__all__ = ["WORKLOADS", "Workload"]

Components = Mapping[str, Any]  # name -> component, or a stand-in with the same methods (a guarded replica)

# --- simulated latency curves, (batch, ms) points: linear between them, flat beyond the last ------------
CHROMA = [(1, 6.0), (64, 16.0)]  # one index scan serves the whole batch: batches well
QDRANT = [(1, 4.0), (16, 64.0), (64, 288.0)]  # per-query work, and worse than linear past 16: batching does not pay
VLLM = [(1, 90.0), (32, 100.0), (64, 180.0)]  # flat until the GPU saturates (continuous batching)
VLLM_GRADER = [(1, 135.0), (32, 150.0), (64, 270.0)]  # the grader reads the question and every document: longer prompts
LLAMACPP = [(1, 30.0), (64, 1920.0)]  # one stream at a time: b calls take b times one
LLAMACPP_GRADER = [(1, 45.0), (64, 2880.0)]
WEB = [(1, 10.0), (32, 26.0)]
SIM_QUESTIONS = [f"question {i}" + ("!" if i % 4 == 0 else "?") for i in range(32)]  # "!": fails the grade


def passes_grade(question: str) -> bool:
    return not question.endswith("!")


def rewritten(question: str) -> str:
    return "search: " + question.rstrip("?!")


def found(query: str) -> str:
    return "docs for " + query


def answered(docs: str) -> str:
    return "answer from " + docs


def rounds(question: str) -> int:
    """How many thoughts a simulated IRCoT question takes: 1 to 4, by its number."""
    return int(question.rstrip("?!").split()[-1]) % 4 + 1


def thought_of(step: list[Any]) -> str:
    """A simulated chain-of-thought step from (question, step number, docs): the last one gives the answer."""
    question, number, docs = step
    text = f"{question} thought {number} on {docs}"
    return text + " so the answer is " + question if number + 1 >= rounds(question) else text


def gives_answer(thought: str) -> bool:
    return "answer is" in thought.lower()


# --- CRAG ---------------------------------------------------------------------------------------------
class CragState(TypedDict, total=False):
    question: str
    docs: Any
    relevant: bool
    query: str
    answer: str


def crag_graph(steps: CragSteps, c: Components) -> Any:
    """retrieve -> grade -(relevant)-> generate; -(not)-> rewrite -> search -> generate."""
    from langgraph.graph import END, START, StateGraph

    graph = StateGraph(CragState)
    graph.add_node("retrieve", lambda s: {"docs": steps.retrieve(c, s["question"])})
    graph.add_node("grade", lambda s: {"relevant": steps.grade(c, s["question"], s["docs"])})
    graph.add_node("rewrite", lambda s: {"query": steps.rewrite(c, s["question"])})
    graph.add_node("search", lambda s: {"docs": steps.search(c, s["query"])})
    graph.add_node("generate", lambda s: {"answer": steps.generate(c, s["question"], s["docs"])})
    graph.add_edge(START, "retrieve")
    graph.add_edge("retrieve", "grade")
    graph.add_conditional_edges("grade", _route_graded, {"relevant": "generate", "not relevant": "rewrite"})
    graph.add_edge("rewrite", "search")
    graph.add_edge("search", "generate")
    graph.add_edge("generate", END)
    return graph.compile()


def _route_graded(s: CragState) -> str:
    return "relevant" if s["relevant"] else "not relevant"


@dataclass(frozen=True)
class CragSteps:
    """CRAG's steps over a components mapping, shared by the sequential code and the graph's nodes."""

    retrieve: Callable[[Components, str], Any]
    grade: Callable[[Components, str, Any], bool]
    rewrite: Callable[[Components, str], str]
    search: Callable[[Components, str], Any]
    generate: Callable[[Components, str, Any], str]
    finish: Callable[[str, Any, str, bool], Any]

    def sequential(self, c: Components, inputs: Mapping[str, Any]) -> Any:
        question = inputs["question"]
        docs = self.retrieve(c, question)
        relevant = self.grade(c, question, docs)
        if not relevant:
            docs = self.search(c, self.rewrite(c, question))
        return self.finish(question, docs, self.generate(c, question, docs), relevant)

    def invoke(self, graph: Any, inputs: Mapping[str, Any]) -> Any:
        s = graph.invoke({"question": inputs["question"]})
        return self.finish(s["question"], s["docs"], s["answer"], s["relevant"])

    async def ainvoke(self, graph: Any, inputs: Mapping[str, Any]) -> Any:
        s = await graph.ainvoke({"question": inputs["question"]})
        return self.finish(s["question"], s["docs"], s["answer"], s["relevant"])


SIM_CRAG = CragSteps(
    retrieve=lambda c, q: c["retriever"].run(q),
    grade=lambda c, q, docs: c["grader"].run(q),
    rewrite=lambda c, q: c["rewriter"].run(q),
    search=lambda c, query: c["web"].run(query),
    generate=lambda c, q, docs: c["generator"].run(docs),
    finish=lambda q, docs, answer, relevant: answer,
)

REAL_CRAG = CragSteps(
    retrieve=lambda c, q: c["retriever"].retrieve(q),
    grade=lambda c, q, docs: c["grader"].grade(q, docs),
    rewrite=lambda c, q: c["rewriter"].rewrite(q),
    search=lambda c, query: c["web"].search(query),
    generate=lambda c, q, docs: c["llm"].generate(q, docs),
    finish=lambda q, docs, answer, relevant: {"answer": answer, "sources": sources(docs), "graded_relevant": relevant},
)


def capture_sim_crag(c: Components) -> patchkit.Pipeline:
    retriever, grader, rewriter, web, generator = c["retriever"], c["grader"], c["rewriter"], c["web"], c["generator"]
    question = SIM_QUESTIONS[1]
    with patchkit.capture(run=False, output="answer") as pipeline:
        docs = retriever.run(question)
        if not grader.run(question):
            docs = web.run(rewriter.run(question))
        answer = generator.run(docs)  # noqa: F841 - the pipeline's output
    return pipeline


def capture_real_crag(c: Components) -> patchkit.Pipeline:
    """examples/crag.py's own captured pipeline, over the components `real_crag` hands out."""
    from examples import crag

    return crag.pipeline


def sim_crag(retriever: list[tuple[float, float]], llm: list[tuple[float, float]], grader: list[tuple[float, float]],
             llm_resource: str) -> dict[str, Component]:
    return {
        "retriever": Simulated(retriever, output=found),
        "grader": Simulated(grader, resource=llm_resource, max_batch=32, output=passes_grade),
        "rewriter": Simulated(llm, resource=llm_resource, max_batch=32, output=rewritten),
        "web": Simulated(WEB, max_batch=32, output=found),
        "generator": Simulated(llm, resource=llm_resource, output=answered),
    }


def real_crag() -> dict[str, Component]:
    """The very components of examples/crag.py, so that its pipeline runs on them."""
    from examples import crag

    return {"retriever": crag.retriever, "grader": crag.grader, "rewriter": crag.rewriter, "web": crag.web, "llm": crag.llm}


# --- IRCoT --------------------------------------------------------------------------------------------
class IrcotState(TypedDict, total=False):
    question: str
    docs: Any
    thoughts: list[str]


@dataclass(frozen=True)
class IrcotSteps:
    """IRCoT's steps: retrieve, then think; a thought that gives the answer (or the last allowed) ends it."""

    retrieve: Callable[[Components, str], Any]
    think: Callable[[Components, str, list[str], Any], str]
    more: Callable[[Components, Any, str], Any]  # the docs so far and a thought -> the docs after retrieving with it
    finish: Callable[[str, list[str], Any], Any]
    max_rounds: int
    done: Callable[[str], bool] = field(default=gives_answer)

    def sequential(self, c: Components, inputs: Mapping[str, Any]) -> Any:
        question = inputs["question"]
        docs = self.retrieve(c, question)
        thoughts: list[str] = []
        while len(thoughts) < self.max_rounds:
            thought = self.think(c, question, thoughts, docs)
            thoughts.append(thought)
            if self.done(thought):
                break
            docs = self.more(c, docs, thought)
        return self.finish(question, thoughts, docs)

    def graph(self, c: Components) -> Any:
        """retrieve -> think -(answered or last round)-> end; -(else)-> retrieve_more -> think."""
        from langgraph.graph import END, START, StateGraph

        def think(s: IrcotState) -> IrcotState:
            thoughts = list(s.get("thoughts", []))
            thoughts.append(self.think(c, s["question"], thoughts, s["docs"]))
            return {"thoughts": thoughts}

        def route(s: IrcotState) -> str:
            last = s["thoughts"][-1]
            return "end" if self.done(last) or len(s["thoughts"]) >= self.max_rounds else "more"

        graph = StateGraph(IrcotState)
        graph.add_node("retrieve", lambda s: {"docs": self.retrieve(c, s["question"]), "thoughts": []})
        graph.add_node("think", think)
        graph.add_node("retrieve_more", lambda s: {"docs": self.more(c, s["docs"], s["thoughts"][-1])})
        graph.add_edge(START, "retrieve")
        graph.add_edge("retrieve", "think")
        graph.add_conditional_edges("think", route, {"end": END, "more": "retrieve_more"})
        graph.add_edge("retrieve_more", "think")
        return graph.compile()

    def invoke(self, graph: Any, inputs: Mapping[str, Any]) -> Any:
        s = graph.invoke({"question": inputs["question"]}, {"recursion_limit": 4 * self.max_rounds + 4})
        return self.finish(s["question"], s["thoughts"], s["docs"])

    async def ainvoke(self, graph: Any, inputs: Mapping[str, Any]) -> Any:
        s = await graph.ainvoke({"question": inputs["question"]}, {"recursion_limit": 4 * self.max_rounds + 4})
        return self.finish(s["question"], s["thoughts"], s["docs"])


SIM_IRCOT = IrcotSteps(
    retrieve=lambda c, q: c["retriever"].run(q),
    think=lambda c, q, thoughts, docs: c["generator"].run([q, len(thoughts), docs]),
    more=lambda c, docs, thought: c["retriever"].run(thought),
    finish=lambda q, thoughts, docs: thoughts[-1],
    max_rounds=4,
)


def _real_ircot_steps() -> IrcotSteps:
    from examples.ircot import final_answer, step_prompt
    from examples.ircot import gives_answer as real_gives_answer

    return IrcotSteps(
        retrieve=lambda c, q: c["retriever"].retrieve(q),
        think=lambda c, q, thoughts, docs: c["llm"].generate(step_prompt(q, thoughts), docs),
        more=lambda c, docs, thought: merge_hits(docs, c["retriever"].retrieve(thought)),
        finish=lambda q, thoughts, docs: {"answer": final_answer(thoughts), "sources": sources(docs), "rounds": len(thoughts)},
        max_rounds=3,
        done=real_gives_answer,
    )


def capture_sim_ircot(c: Components) -> patchkit.Pipeline:
    retriever, generator = c["retriever"], c["generator"]
    question = SIM_QUESTIONS[1]
    with patchkit.capture(run=False, output="answer") as pipeline:
        docs = retriever.run(question)
        thoughts = []
        while len(thoughts) < 4:
            thought = generator.run([question, len(thoughts), docs])
            thoughts.append(thought)
            if gives_answer(thought):
                break
            docs = retriever.run(thought)
        answer = thoughts[-1]  # noqa: F841 - the pipeline's output
    return pipeline


def capture_real_ircot(c: Components) -> patchkit.Pipeline:
    """examples/ircot.py's own captured pipeline, over the components `real_ircot` hands out."""
    from examples import ircot

    return ircot.pipeline


def sim_ircot(retriever: list[tuple[float, float]], llm: list[tuple[float, float]], llm_resource: str) -> dict[str, Component]:
    return {
        "retriever": Simulated(retriever, output=found),
        "generator": Simulated(llm, resource=llm_resource, output=thought_of),
    }


def real_ircot() -> dict[str, Component]:
    """The very components of examples/ircot.py, so that its pipeline runs on them."""
    from examples import ircot

    return {"retriever": ircot.retriever, "llm": ircot.llm}


REAL_QUESTIONS = [
    "How do I catch an exception in Python?",
    "What does the with statement do?",
    "Which module reads and writes CSV files?",
    "How do I run code when a loop finishes without break?",
    "Which statement do I use to leave a loop early?",
    "How do I make a class usable in a with statement?",
]


# --- the workloads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One pipeline on one set of components, with its resource budget and the inputs the load cycles through.

    `pool`: the resource units every system gets: patchkit plans its replicas within it; the baseline
    servers run as many worker processes, and a call holds one unit of its component's resource type.
    """

    name: str
    description: str
    build: Callable[[], dict[str, Component]]
    capture: Callable[[Components], patchkit.Pipeline]
    steps: CragSteps | IrcotSteps | Callable[[], IrcotSteps]
    pool: dict[str, int]
    questions: list[str]
    real: bool = False

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return [{"question": q} for q in self.questions]

    def resolved_steps(self) -> CragSteps | IrcotSteps:
        return self.steps if isinstance(self.steps, (CragSteps, IrcotSteps)) else self.steps()

    def sequential(self, c: Components, inputs: Mapping[str, Any]) -> Any:
        return self.resolved_steps().sequential(c, inputs)

    def graph(self, c: Components) -> Any:
        steps = self.resolved_steps()
        return crag_graph(steps, c) if isinstance(steps, CragSteps) else steps.graph(c)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("crag-gpu", "CRAG: Chroma-like retriever, vLLM-like grader, rewriter and generator on GPUs",
                 lambda: sim_crag(CHROMA, VLLM, VLLM_GRADER, "gpu"), capture_sim_crag, SIM_CRAG, {"cpu": 4, "gpu": 4},
                 SIM_QUESTIONS),
        Workload("crag-cpu", "CRAG: Qdrant-like retriever, llama.cpp-like grader, rewriter and generator on CPUs",
                 lambda: sim_crag(QDRANT, LLAMACPP, LLAMACPP_GRADER, "cpu"), capture_sim_crag, SIM_CRAG, {"cpu": 8},
                 SIM_QUESTIONS),
        Workload("ircot-gpu", "IRCoT: Chroma-like retriever, vLLM-like generator on GPUs",
                 lambda: sim_ircot(CHROMA, VLLM, "gpu"), capture_sim_ircot, SIM_IRCOT, {"cpu": 2, "gpu": 2}, SIM_QUESTIONS),
        Workload("ircot-cpu", "IRCoT: Qdrant-like retriever, llama.cpp-like generator on CPUs",
                 lambda: sim_ircot(QDRANT, LLAMACPP, "cpu"), capture_sim_ircot, SIM_IRCOT, {"cpu": 4}, SIM_QUESTIONS),
        Workload("crag-real", "CRAG (examples/crag.py): FAISS + MiniLM, SmolLM2 on llama.cpp as grader, rewriter, generator",
                 real_crag, capture_real_crag, REAL_CRAG, {"cpu": 2}, REAL_QUESTIONS, real=True),
        Workload("ircot-real", "IRCoT (examples/ircot.py): FAISS + MiniLM, SmolLM2 on llama.cpp",
                 real_ircot, capture_real_ircot, _real_ircot_steps, {"cpu": 2}, REAL_QUESTIONS, real=True),
    )
}
