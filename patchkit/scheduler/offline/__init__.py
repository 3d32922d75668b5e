"""The offline planner: profile, fit, solve, and the `Plan` it makes (Patchwork sections 3.3-3.4).

It never imports the online scheduler, which reads only the `Plan` it produces.
"""
