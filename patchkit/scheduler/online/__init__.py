"""The online scheduler's policies (Patchwork sections 3.4-3.7): the SLO policy and its estimators,
and autoscaling's decisions. `patchkit.serving` applies them; nothing here imports it.

It imports nothing of the offline planner but the `Plan` data type.
"""
