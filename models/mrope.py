"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): three rows (temporal, height, width) per token.

mmkit's own implementation of what transformers' `Qwen2VLModel.get_rope_index` computes
(transformers 5.x), driven by the processor's placeholder ranges instead of token ids:

- text tokens: the same position in all three rows, one past the previous token's group;
- a vision item with merged grid (t, h, w) at start position s: row 0 = s + floor(t_idx *
  interval), row 1 = s + h_idx, row 2 = s + w_idx, in (t, h, w) raster order; the text after it
  continues at s + max(h, w) (transformers 5's rule; the temporal extent does not advance it);
- generated token i (0-based in the whole sequence) sits at i + delta in all three rows, with
  `delta = max(prompt positions) + 1 - prompt_len` (transformers' `rope_deltas`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MRopeItem:
    """One vision item's placeholder run and its merged grid, in prompt order."""

    offset: int  # first placeholder token in the prompt
    length: int  # placeholder tokens (= t * h * w of the merged grid)
    grid_thw: tuple[int, int, int]  # merged grid: (frames / temporal_patch, h / merge, w / merge)
    time_interval: float = 1.0  # temporal position step (Qwen2.5-VL video: tokens_per_second * s/grid)


def mrope_positions(num_tokens: int, items: list[MRopeItem]) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] (int64) of a prompt and its generation delta."""
    rows: list[torch.Tensor] = []
    pos = 0  # next start position
    cursor = 0  # next token index
    for item in sorted(items, key=lambda it: it.offset):
        if item.offset < cursor:
            raise ValueError(f"mrope_positions: overlapping placeholder ranges at token {item.offset}")
        text_len = item.offset - cursor
        if text_len:
            rows.append(torch.arange(pos, pos + text_len).expand(3, -1))
            pos += text_len
        t, h, w = item.grid_thw
        if t * h * w != item.length:
            raise ValueError(f"mrope_positions: a grid {item.grid_thw} has {t * h * w} tokens, the placeholder "
                             f"run {item.length}")
        t_idx = (torch.arange(t) * item.time_interval).long()
        tt, hh, ww = torch.meshgrid(t_idx, torch.arange(h), torch.arange(w), indexing="ij")
        rows.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w)
        cursor = item.offset + item.length
    if cursor < num_tokens:
        rows.append(torch.arange(pos, pos + num_tokens - cursor).expand(3, -1))
    positions = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions.contiguous(), delta
