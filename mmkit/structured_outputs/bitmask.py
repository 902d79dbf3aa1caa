"""The step's token bitmask: filled for every constrained row in one call, applied in place."""

from __future__ import annotations

import torch

from mmkit.layers import cpu_kernels


class GrammarBitmask:
    """Owned by the sampler: a reusable CPU int32 buffer `[rows, ceil(vocab / 32)]`, bit j of
    a row set when token j is allowed (xgrammar's layout)."""

    def __init__(self) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        self._buffer: torch.Tensor | None = None

    def _rows(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        width = (vocab_size + 31) // 32
        if self._buffer is None or self._buffer.shape[0] < num_rows or self._buffer.shape[1] != width:
            self._buffer = self._xgr.allocate_token_bitmask(max(num_rows, 8), vocab_size)
        return self._buffer[:num_rows]

    def apply(self, logits: torch.Tensor, matchers: list, indices: list[int]) -> None:
        """Set to -inf every logit of row `indices[i]` that `matchers[i]` forbids.

        logits: [num_rows, vocab] float32 (CPU or CUDA), modified in place. The bitmask is
        built on CPU (xgrammar's matchers live there) in one batched call, then copied to the
        logits' device once.
        """
        if not indices:
            return
        vocab = logits.shape[-1]
        # Row i of the bitmask masks row i of the logits (xgrammar's `indices` convention);
        # rows of unconstrained requests are neither filled nor applied.
        bitmask = self._rows(logits.shape[0], vocab)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=indices)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        elif cpu_kernels.apply_token_bitmask(logits, bitmask, indices):
            return  # mmkit's C kernel: skips all-allowed words, fills all-banned ones
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices, vocab_size=vocab)
