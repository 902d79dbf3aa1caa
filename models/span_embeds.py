"""An item's embedding rows for its whole placeholder span (see processors/spans.py).

transformers embeds every prompt token and then scatters the image features into the
image-token positions (`masked_scatter`); for a span that interleaves image tokens with
layout tokens ([IMG_BREAK], <row_1_col_2>, timestamps) the same rows are: the token
embeddings of the span, with the features written into its image-token rows in order.
"""

from __future__ import annotations

from typing import Callable

import torch


def span_embeddings(embed_tokens: Callable[[torch.Tensor], torch.Tensor], span_ids: torch.Tensor,
                    image_token_id: int, features: torch.Tensor) -> torch.Tensor:
    """span_ids [L] (long), features [num_image_tokens, hidden] -> rows [L, hidden]."""
    rows = embed_tokens(span_ids.to(torch.long))  # [L, hidden]
    mask = span_ids == image_token_id
    num_slots = int(mask.sum())
    if num_slots != features.shape[0]:
        raise ValueError(f"an item produced {features.shape[0]} image features but its placeholder span holds "
                         f"{num_slots} image tokens; refusing to misalign them")
    rows[mask] = features.to(rows.dtype)
    return rows
