"""The pipeline of the Patchwork paper's Figure 9, with small components of its own.

Run it: `python examples/figure9.py` prints the answer, a re-run on a new question and the graph,
then deploys the pipeline (one worker process per component) and asks the endpoint. Or serve it:
`patchkit serve examples/figure9.py`.
"""

from __future__ import annotations

import patchkit
from patchkit import Component, make

DOCS = {
    "linux": "Ubuntu and Linux Mint suit beginners: a friendly installer and a large community.",
    "python": "Python reads like pseudocode; start with the official tutorial.",
}


class Retriever(Component):
    def __init__(self, topk: int = 3) -> None:
        self.topk = topk

    def setup(self) -> None:
        self.index = {key: set(text.lower().split()) | {key} for key, text in DOCS.items()}

    @make(batch=True, read_only=True)
    def retrieve(self, query: list[str]) -> list[list[str]]:
        hits = []
        for q in query:
            words = set(q.lower().replace("?", "").split())
            ranked = sorted(self.index, key=lambda k: -len(words & self.index[k]))
            hits.append([DOCS[k] for k in ranked[: self.topk] if words & self.index[k]])
        return hits


class Grader(Component):
    def __init__(self, sys_prompt: str) -> None:
        self.sys_prompt = sys_prompt

    @make(read_only=True)
    def generate(self, docs: list[str]) -> bool:
        return bool(docs)


class Rewriter(Component):
    def __init__(self, writer_prompt: str) -> None:
        self.writer_prompt = writer_prompt

    @make(read_only=True)
    def custom_inference(self, query: str) -> str:
        return query + " linux python"


class WebSearch(Component):
    @make(read_only=True)
    def search(self, query: str) -> list[str]:
        return [f"web result for {query!r}"]


class LLM(Component):
    def __init__(self, temp: float = 0.7) -> None:
        self.temp = temp

    @make(read_only=True)
    def generate(self, query: str, docs: list[str]) -> str:
        return f"Q: {query} | based on {len(docs)} document(s): {docs[0] if docs else 'none'}"


rewriter = Rewriter(writer_prompt="Add more context to query.")
retriever = Retriever(topk=3)
grader = Grader(sys_prompt="Does retrieved docs have relevant info?")
web = WebSearch()
llm = LLM(temp=0.7)


def build(query: str) -> str:
    with patchkit.capture():
        retrieved_data = retriever.retrieve(query)
        has_relevant_doc = grader.generate(retrieved_data)
        if not has_relevant_doc:
            better_query = rewriter.custom_inference(query)
            doc = web.search(better_query)
            return llm.generate(better_query, doc)
        else:
            return llm.generate(query, retrieved_data)


# The capture runs its body once, eagerly (these components are cheap); `patchkit serve` serves it.
first_answer = build("Which Linux distro suits beginners best?")
pipeline = patchkit.last_pipeline()

if __name__ == "__main__":
    print(first_answer)
    print(pipeline)
    print(pipeline(query="What should I cook tonight?"))
    print(pipeline.graph.to_mermaid())
    with patchkit.deploy(pipeline) as endpoint:
        print(f"deployed at {endpoint.url}")
        for question in ("Which Linux distro suits beginners best?", "What should I cook tonight?"):
            print(endpoint.query(query=question))
        for name, component in endpoint.stats()["components"].items():
            pids = [r["pid"] for r in component["replicas"]]
            print(f"  {name}: worker pid {pids}, calls {sum(m['calls'] for m in component['methods'].values())}")
