"""Scheduling, in two halves that never import each other (but for the `Plan` data type):

- `offline/`: before serving. Profile each component (`profiler`), fit its batch latency
  (`pwl`), solve the MILP for replicas, resources and batch sizes (`milp`, over `problem`,
  `candidates`, `feasibility` and `solvers`), within a resource pool (`pool`): a `Plan` (`plan`,
  `planner`).
- `online/`: the policies that serving follows. Keep requests in their SLO (`slo`, with the
  estimators of `traces`, `averages`, `xgb` and `estimator`) and decide when a component gets a
  replica more or less (`autoscale`).

`patchkit.serving` runs a deployed pipeline with them; both drive workers through `patchkit.orchestrator`.
"""
