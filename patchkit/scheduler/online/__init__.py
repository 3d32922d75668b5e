"""The online scheduler: the front-end that serves a deployed pipeline (Patchwork sections 3.5-3.7).

It imports nothing of the offline planner but the `Plan` data type.
"""
