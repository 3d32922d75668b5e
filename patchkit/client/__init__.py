"""The user's side of patchkit: capture() (`capture`), Pipeline (`pipeline`), plan() (`planning`),
deploy() and Endpoint (`endpoint`). It is the top layer: nothing else of patchkit imports it but for
type hints. `Component` and `make` live in the leaf package `patchkit.core`.
"""
