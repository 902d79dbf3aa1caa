"""The types a multimodal request carries from its processor to the model: the prompt positions
an item's embedding rows replace (`PlaceholderRange`) and one item's model inputs
(`MultiModalKwargs`).

They live here, under `multimodal/`, because the engine's input stage and every processor use
them; `mmkit.models.interfaces` re-exports both for the model families (imports point down the
layers: models and processors import multimodal, never the reverse).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# One item's model inputs as the processor builds them, e.g. LLaVA's
# {"pixel_values": [1, 3, H, W]} or Qwen2-VL's {"pixel_values": [patches, dim],
# "image_grid_thw": [1, 3]}. The runner moves them to the model's device, nothing else.
MultiModalKwargs = dict[str, torch.Tensor]


class PlaceholderRange(NamedTuple):
    """Prompt positions [offset, offset + length) that one item's embedding rows replace.

    NOTE: `length` equals the number of rows `embed_multimodal` returns for the item
    (checked by the runner). A NamedTuple, so `(offset, length)` tuples compare equal."""

    offset: int
    length: int
