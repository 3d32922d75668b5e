"""capture() in a Jupyter cell, executed by a real kernel; the graph renders as SVG."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

TESTS = Path(__file__).parent

CELLS = [
    f"import sys; sys.path.insert(0, {str(TESTS)!r})\nimport patchkit\nfrom components import Generator, Grader, Retriever",
    "retriever, grader, llm = Retriever(), Grader(), Generator()\nquery = 'How do I catch an exception?'",
    "with patchkit.capture() as pipeline:\n"
    "    docs = retriever.retrieve(query)\n"
    "    if not grader.grade(query, docs):\n"
    "        docs = retriever.retrieve(llm.rewrite(query))\n"
    "    answer = llm.generate(query, docs)",
    "print(repr(pipeline(query='What is a generator?')))\nprint(pipeline.output, sorted(pipeline.inputs))",
    "pipeline.graph",
    # A component defined in the notebook itself travels to its worker by value.
    "class Shout(patchkit.Component):\n"
    "    @patchkit.make\n"
    "    def shout(self, text: str) -> str:\n"
    "        return text.upper() + '!'\n"
    "shouter = Shout()\n"
    "with patchkit.capture() as loud:\n"
    "    answer = shouter.shout(llm.generate(query, retriever.retrieve(query)))",
    "endpoint = patchkit.deploy(loud)\n"
    "print(endpoint.query(query='What is a generator?') == loud(query='What is a generator?'))\n"
    "print(await endpoint.aquery(query='What is a generator?') == loud(query='What is a generator?'))\n"
    "endpoint.close()\n"
    "print(endpoint)",
]


@pytest.mark.slow
def test_capture_in_a_notebook_cell(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(o.get("text", "") for o in nb.cells[3].outputs)
    sys.path.insert(0, str(TESTS))
    from components import Generator, Retriever

    expected = Generator().generate("What is a generator?", Retriever().retrieve("What is a generator?"))
    assert printed.splitlines() == [repr(expected), "answer ['query']"]
    svg = nb.cells[4].outputs[0]["data"]["image/svg+xml"]
    assert "<svg" in svg and "retriever.retrieve" in svg and "grader.grade" in svg
    deployed = "".join(o.get("text", "") for o in nb.cells[6].outputs).splitlines()
    assert deployed[:2] == ["True", "True"] and deployed[2].endswith(" closed>")


@pytest.mark.slow
def test_the_quickstart_notebook_runs_on_real_components(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="the notebook answers with SmolLM2 through llama.cpp: pip install -e '.[llm]'")
    pytest.importorskip("faiss", reason="the notebook searches a FAISS index: pip install -e '.[retrieval]'")
    nb = nbformat.read(TESTS.parent / "examples" / "quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [cell for cell in nb.cells if cell.cell_type == "code"]

    def shown(i: int, kind: str = "text/plain") -> str:
        return "".join(o.get("text", "") or o.get("data", {}).get(kind, "") for o in code[i].outputs)

    assert "'try'" in shown(1) or "'exceptions'" in shown(1)  # the pydoc topics on exceptions come first
    assert "'answer':" in shown(2) and "'sources':" in shown(2)
    svg = shown(3, "image/svg+xml")
    assert "<svg" in svg and "retriever.retrieve" in svg and "llm.generate" in svg
    assert "'answer':" in shown(4) and "'answer':" in shown(5)
    assert "llm.generate" in shown(6) and "retriever.retrieve" in shown(6)


ASYNC_CELLS = [
    "import asyncio\nimport patchkit",
    # Defined in the notebook: its class travels to the worker by value, its async setup with it.
    "class Lookup(patchkit.Component):\n"
    "    async def setup(self) -> None:\n"
    "        self.table = {'a': 1, 'b': 2}\n"
    "    @patchkit.make(max_concurrency=8)\n"
    "    async def find(self, key: str) -> int:\n"
    "        await asyncio.sleep(0.01)\n"
    "        return self.table[key]\n"
    "    @patchkit.make(stream=True)\n"
    "    async def spell(self, key: str):\n"
    "        for letter in key * 2:\n"
    "            await asyncio.sleep(0)\n"
    "            yield letter\n"
    "lookup = Lookup()\n"
    "print(lookup.find('a'), lookup.spell('b'))",  # the kernel's loop is running while the cell runs
    "key = 'b'\n"
    "with patchkit.capture(output='found') as found_it:\n"
    "    found = (lookup.find(key), lookup.spell(key))\n"
    "print(found, found_it(key='a'))",
    "with patchkit.deploy(found_it) as endpoint:\n"
    "    print(endpoint.query(key='a'), await endpoint.aquery(key='b'))",
]


@pytest.mark.slow
def test_async_components_in_a_notebook_cell(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in ASYNC_CELLS])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = ["".join(o.get("text", "") for o in cell.outputs).strip() for cell in nb.cells[1:]]
    assert printed == ["1 bb", "(2, 'bb') (1, 'aa')", "[1, 'aa'] [2, 'bb']"]
