"""`LlamaCppGenerator` and its engine: GGUF models through llama-cpp-python, one context batching many sequences.

`generator` holds the component; `engine` the continuous-batching loop over one llama.cpp context, with its
`sequence`s, sized by `config`, its turns split as `engine_turn` says (a leaf the planner's cost model
replays); the KV states it keeps and reuses are `kv_state` (a sequence's state cut into runs of
positions), `kv_tree` (prompt prefixes within a byte budget), `document_cache` (named prompt pieces,
restored instead of evaluated), `kv_blend` (a document's KV placed at any position, `kv_reuse="blend"`)
and `kv_rope` (its cells moved there, their keys rotated on the host).
"""

from patchkit.components.generators.llama.generator import LlamaCppGenerator

__all__ = ["LlamaCppGenerator"]
