"""The captured program: `Pipeline` (its code, its variables and its run) and its identity (`identity`), which says
what a version of it and of each of its components is.

It sits below every layer that runs a pipeline (serving, the planner, the configuration, the server, the client)
and above `capture`, which makes it: those layers name this type without reaching up to the user's API.
"""
