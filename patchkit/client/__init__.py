"""The user's side of patchkit: capture() (`capture`), plan() (`planning`), deploy() (`deploy`), the Endpoint it
returns (`endpoint`) and the streams it reads (`streams`). It is the top layer: nothing else of patchkit imports it.
`Component` and `make` live in `patchkit.core`; the `Pipeline` a capture makes, in `patchkit.program`.
"""
