"""The HTTP layer over the front-end: routes (`http`), the input schema at the edge (`inputs`), the
connections under them (`connections`: malformed HTTP as JSON errors), the Prometheus exposition
(`metrics`), and the front-end's homes: its own process, the foreground of `patchkit serve`, or a
thread of the user's process (`process`).
"""
