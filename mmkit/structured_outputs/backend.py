"""The xgrammar backend of one engine: tokenizer info, compiler and compiled-grammar cache."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from mmkit.structured_outputs.spec import GrammarSpec, build_grammar, xgrammar_message

if TYPE_CHECKING:
    from mmkit.sampling_params import StructuredOutputsParams
    from mmkit.structured_outputs.request import StructuredOutputRequest


class StructuredOutputBackend:
    """Built once per engine from its HF tokenizer (xgrammar's `TokenizerInfo` scans the
    vocabulary once). `compile` caches by `GrammarSpec`, so a batch of 10,000 requests with
    the same schema compiles it once; `new_request` makes a fresh per-sequence matcher.

    `vocab_size` is the width of the model's logits (it may exceed the tokenizer's length:
    padded LM heads); ids past the tokenizer are never allowed. `stop_token_ids` are the
    engine's EOS ids: the only tokens allowed once the grammar is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] | list[int],
                 max_cached: int = 256, max_threads: int = 8) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        # xgrammar's own cache is keyed by its input text; ours skips even the Python-side
        # conversion and bounds memory by entries.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self.max_cached = max_cached
        self.num_compiles = 0  # cache misses (tests check one compile per distinct spec)

    def compile(self, params: "StructuredOutputsParams"):
        """The xgrammar `CompiledGrammar` of `params` (cached by its spec)."""
        spec = params.spec
        compiled = self._cache.get(spec)
        if compiled is not None:
            self._cache.move_to_end(spec)
            return compiled
        try:
            compiled = self._compile(spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError
            raise ValueError(f"structured_outputs.{params.kind}: xgrammar could not compile it for this "
                             f"tokenizer: {xgrammar_message(exc)}") from exc
        self.num_compiles += 1
        self._cache[spec] = compiled
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec):
        # One translation of a spec into an xgrammar Grammar (spec.build_grammar, also the
        # validator's); the compiler turns it into token masks for this tokenizer.
        return self.compiler.compile_grammar(build_grammar(spec))

    def new_request(self, params: "StructuredOutputsParams") -> "StructuredOutputRequest":
        from mmkit.structured_outputs.request import StructuredOutputRequest

        return StructuredOutputRequest(self.compile(params))
