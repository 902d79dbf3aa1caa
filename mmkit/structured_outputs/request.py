"""Per-sequence grammar state: an xgrammar matcher advanced with each accepted token."""

from __future__ import annotations


class StructuredOutputRequest:
    """One sequence's position in its grammar.

    The sampler reads `matcher` to fill this row's token bitmask; the engine calls `accept`
    with each sampled token. A sequence forked for n > 1 gets `fork()` (an independent copy at
    the same position); a sequence whose state was lost gets `rebuild(output_token_ids)`.
    """

    def __init__(self, compiled_grammar, matcher=None) -> None:
        import xgrammar as xgr

        self.compiled_grammar = compiled_grammar
        self.matcher = matcher if matcher is not None else xgr.GrammarMatcher(compiled_grammar)
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the matcher
        is then unchanged). Once terminated (EOS accepted), further tokens are refused."""
        ok = self.matcher.accept_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fork(self) -> "StructuredOutputRequest":
        child = StructuredOutputRequest(self.compiled_grammar, self.matcher.fork())
        child.num_accepted = self.num_accepted
        return child

    def rebuild(self, output_token_ids: list[int]) -> "StructuredOutputRequest":
        """A fresh matcher replayed over the tokens generated so far."""
        state = StructuredOutputRequest(self.compiled_grammar)
        for token in output_token_ids:
            if not state.accept(token):
                break
        return state

    def is_completed(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return self.matcher.is_completed()

    def is_terminated(self) -> bool:
        """EOS was accepted: nothing more may be generated."""
        return self.matcher.is_terminated()
