"""The scheduler: the online front-end (HTTP, batching queues, dispatch) and, in later modules, the
offline planner. It drives workers through `patchkit.orchestrator`.
"""
