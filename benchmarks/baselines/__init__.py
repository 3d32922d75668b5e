"""The systems `benchmarks/throughput.py` compares patchkit with: the same pipelines written as plain
Python (a sequential server's code) and as LangGraph graphs, over the same component objects, and
the pre-fork HTTP server that serves both (`server.py`)."""
