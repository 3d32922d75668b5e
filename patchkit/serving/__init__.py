"""Serving a deployed pipeline: the front-end, over the orchestrator's workers.

    frontend.py    Frontend: the three parts below, together
    deployment.py  replica sets, queues, supervisor, autoscaler, prefetcher, wired from the config and plan
    runner.py      RequestRunner: admission, the pipeline's code per request, its calls, `outcome_of`
    stats.py       StatsCollector: counters and views; snapshot.py, what metrics read of them
    queues.py      BatchQueue: batching per (component, method); waves.py, request waves
    replicas.py    ReplicaSet: each replica's batches in flight, stuck replicas; router.py, the routing policy
    bridge.py      greenlets: the pipeline's blocking code over the event loop
    scaling.py     Autoscaler: the scheduler's `ScalingPolicy` applied through the supervisor
    prefetch.py    prefetching for the hybrid retriever

The policies it follows (the SLO policy, its estimators, autoscaling's decisions) are
`patchkit.scheduler.online`'s; the HTTP layer over the front-end is `patchkit.server`.
"""
