"""Workers and where they run: the worker process, the RPC between it and the front-end, and the
backends that start, stop and watch replicas (`local` subprocesses, `ray` actors across a Ray
cluster, `inprocess` for tests and pdb).

The orchestrator never imports the scheduler: the front-end drives it through `Supervisor`.
"""
