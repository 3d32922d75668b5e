"""How a `LlamaEngine` sequence samples its tokens: `SamplerParams`, and the llama.cpp sampler chain made of them.

`LlamaCppGenerator` fills the params from its own settings and the call's options (temperature, top_p, seed,
penalties, a grammar for a JSON answer, ignore_eos); the engine builds one chain per sequence with `chain`
and frees it when the sequence ends (the shared greedy chain excepted). The chain is llama-cpp-python's own
completion's: greedy at temperature 0, else top-k 40, top-p, min-p 0.05, the temperature and a draw seeded
with `seed`; a grammar, the penalties and a ban of the end-of-generation tokens come first where asked.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["GREEDY", "SamplerParams", "chain", "json_grammar", "token_logprobs"]

TOP_K, MIN_P = 40, 0.05
DEFAULT_TOP_P = 0.95  # llama-cpp-python's completion default


@dataclass(frozen=True)
class SamplerParams:
    """One sequence's sampling: at `temperature` (0: greedy) from the `top_p` nucleus, drawn with `seed`;
    `grammar` (GBNF text) constrains the tokens; `presence_penalty` and `frequency_penalty` as OpenAI's
    (over the last `penalty_last_n` tokens); `ignore_eos` bans the end-of-generation tokens."""

    temperature: float = 0.0
    top_p: float = DEFAULT_TOP_P
    seed: int = 0
    grammar: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    ignore_eos: bool = False
    logprobs: int | None = None  # the model's logprobs of each token made, with this many alternatives (None: none)

    @property
    def greedy(self) -> bool:
        """Whether the shared, stateless greedy chain samples it (no state of its own: no grammar, no penalties)."""
        plain = self.grammar is None and not (self.presence_penalty or self.frequency_penalty or self.ignore_eos)
        return self.temperature == 0 and plain


GREEDY = SamplerParams()


def json_grammar(schema: dict[str, Any] | None) -> str:
    """GBNF text for a JSON answer matching `schema` (llama.cpp's converter); any JSON value for None or an
    object schema with nothing more."""
    return _grammar(json.dumps(schema, sort_keys=True) if schema and schema != {"type": "object"} else "")


@functools.lru_cache(maxsize=64)
def _grammar(schema: str) -> str:
    """Made once per schema: the converter is Python, a few milliseconds a schema."""
    from llama_cpp import llama_grammar

    if not schema:
        return str(llama_grammar.JSON_GBNF)
    return str(llama_grammar.json_schema_to_gbnf(schema))


def chain(lib: Any, vocab: Any, params: SamplerParams) -> Any:
    """A new sampler chain for `params`, owned by the caller (`llama_sampler_free` it).

    Raises:
        ValueError: a grammar llama.cpp cannot parse.
    """
    sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    stages = []
    if params.ignore_eos:
        stages.append(_eog_ban(lib, vocab))
    if params.grammar is not None:
        grammar = lib.llama_sampler_init_grammar(vocab, params.grammar.encode(), b"root")
        if not grammar:
            lib.llama_sampler_free(sampler)
            raise ValueError("llama.cpp could not parse the grammar made of response_format's schema")
        stages.append(grammar)
    if params.presence_penalty or params.frequency_penalty:
        stages.append(lib.llama_sampler_init_penalties(lib.llama_vocab_n_tokens(vocab), params.penalty_last_n, 1.0,
                                                       params.frequency_penalty, params.presence_penalty))
    if params.temperature == 0:
        stages.append(lib.llama_sampler_init_greedy())
    else:
        stages += [lib.llama_sampler_init_top_k(TOP_K), lib.llama_sampler_init_top_p(params.top_p, 1),
                   lib.llama_sampler_init_min_p(MIN_P, 1), lib.llama_sampler_init_temp(params.temperature),
                   lib.llama_sampler_init_dist(params.seed & 0xFFFFFFFF)]
    for stage in stages:
        lib.llama_sampler_chain_add(sampler, stage)
    return sampler


def token_logprobs(logits: Any, n_vocab: int, token: int, top: int, text: Any) -> dict[str, Any]:
    """OpenAI's logprobs entry of `token` from one row of raw logits (a ctypes float pointer): its log-probability
    under the model and the `top` likeliest tokens', `text(token)` each token's bytes."""
    import numpy as np

    row = np.ctypeslib.as_array(logits, shape=(n_vocab,)).astype(np.float64)
    row -= row.max()
    row -= np.log(np.exp(row).sum())
    best: list[int] = [int(tok) for tok in np.argsort(-row)[:top]] if top else []

    def entry(tok: int) -> dict[str, Any]:
        piece: bytes = text(tok)
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": float(row[tok]), "bytes": list(piece)}

    return {**entry(token), "top_logprobs": [entry(tok) for tok in best]}


def _eog_ban(lib: Any, vocab: Any) -> Any:
    """A logit bias of -inf on every end-of-generation token of `vocab`."""
    count = lib.llama_vocab_n_tokens(vocab)
    eog = _eog_tokens(lib, vocab, count)
    biases = (lib.llama_logit_bias * len(eog))(*[lib.llama_logit_bias(token, float("-inf")) for token in eog])
    return lib.llama_sampler_init_logit_bias(count, len(eog), biases)


_EOG: dict[tuple[int, int], list[int]] = {}  # by vocabulary (its address, its size): its end-of-generation tokens


def _eog_tokens(lib: Any, vocab: Any, count: int) -> list[int]:
    """The end-of-generation tokens of `vocab`, found once per vocabulary (a pass over every token)."""
    key = (int(getattr(vocab, "value", None) or id(vocab)), count)
    if key not in _EOG:
        _EOG[key] = [token for token in range(count) if lib.llama_vocab_is_eog(vocab, token)]
    return _EOG[key]
