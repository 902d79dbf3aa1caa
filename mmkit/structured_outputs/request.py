"""Per-sequence grammar state: an xgrammar matcher advanced with each accepted token."""

from __future__ import annotations


class StructuredOutputRequest:
    """One sequence's position in its grammar.

    The runner's hook (`hook.py`) reads `matcher` to fill this row's token bitmask and calls
    `accept` with each sampled token. `rebuild(output_token_ids)` replays a sequence whose
    matcher is out of step with its tokens.
    """

    def __init__(self, compiled_grammar, matcher=None) -> None:
        import xgrammar as xgr

        self.compiled_grammar = compiled_grammar
        self.matcher = matcher if matcher is not None else xgr.GrammarMatcher(compiled_grammar)
        self.num_accepted = 0
        self.num_tokens = 0  # tokens offered to `accept`, accepted or not: the sequence position

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the matcher
        is then unchanged). Once terminated (EOS accepted), further tokens are refused."""
        self.num_tokens += 1
        ok = self.matcher.accept_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            self.num_tokens -= num_tokens

    def rebuild(self, output_token_ids: list[int]) -> "StructuredOutputRequest":
        """A fresh matcher replayed over the tokens generated so far (it stops advancing at
        the first token the grammar refuses; `num_tokens` still counts them all)."""
        state = StructuredOutputRequest(self.compiled_grammar)
        for token in output_token_ids:
            if not state.accept(token):
                break
        state.num_tokens = len(output_token_ids)
        return state

    def is_completed(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return self.matcher.is_completed()

    def is_terminated(self) -> bool:
        """EOS was accepted: nothing more may be generated."""
        return self.matcher.is_terminated()
