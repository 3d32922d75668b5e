"""Scheduling, in two halves that never import each other (but for the `Plan` data type):

- `offline/`: before serving. Profile each component (`profiler`), fit its batch latency
  (`pwl`), solve the MILP for replicas, resources and batch sizes (`milp`, over `problem`,
  `candidates`, `feasibility` and `solvers`), within a resource pool (`pool`): a `Plan` (`plan`,
  `planner`).
- `online/`: while serving. The front-end (`frontend`) runs the pipeline per request on greenlets
  (`bridge`), batches calls per method (`queues`, or request waves: `waves`), keeps requests in their
  SLO (`slo`, with the estimators of `traces`, `averages` and `xgb`), adds and removes replicas
  (`autoscale`) and prefetches for the hybrid retriever (`prefetch`).

Both drive workers through `patchkit.orchestrator`; the HTTP layer over the front-end is `patchkit.server`.
"""
