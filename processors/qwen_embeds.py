"""Image embeddings given by the user for Qwen2-VL / Qwen2.5-VL / Qwen3-VL (vLLM's layout).

    multi_modal_data={"image": {"image_embeds": embeds, "image_grid_thw": grid}}
    # or {"image_embeds": {"image_embeds": embeds, "image_grid_thw": grid}}

- `image_grid_thw`: an integer tensor `[N, 3]` (or `[3]` for one image), the patch grid of
  each image before the 2x2 merge, exactly the image processor's `image_grid_thw`. It fixes each
  image's token count, `t * h * w / merge_size**2`, and its M-RoPE positions.
- `image_embeds`: `[sum of the N token counts, width]` (a `[N, tokens, width]` tensor of equal
  counts is accepted too), the images' rows in order. `width` is the text `hidden_size` for
  Qwen2(.5)-VL. For Qwen3-VL it is `(1 + L) * hidden_size`, L = `len(deepstack_visual_indexes)`:
  the merged features, then the L DeepStack feature sets, concatenated on the last dimension,
  which is what transformers' `get_image_features` returns, joined:

      out = hf_model.model.get_image_features(pixel_values, image_grid_thw)
      embeds = torch.cat([torch.cat(out.pooler_output),
                          *(torch.cat(feats) for feats in out.deepstack_features)], dim=-1)

A prompt may hold given image embeddings and a raw video together (mmkit encodes the video).
The shape rules are checked up front; a mismatch is a ValueError naming what was given.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from mmkit.processors.mm_kwargs import integer_table

from mmkit.multimodal.hashing import embeds_content_hash
from mmkit.multimodal.parse import ParsedPrompt

_FIELDS = ("image_grid_thw",)


@dataclass
class GivenEmbedsItem:
    """An image given as embeddings (a `MultiModalItem`, in the place of processors/qwen2_vl.py's
    `VisionItem`): its grid (for the placeholder and M-RoPE) and its rows."""

    grid_thw: tuple[int, int, int]  # patch grid before the 2x2 merge
    num_tokens: int  # t * h * w / merge^2
    embeds: torch.Tensor  # [num_tokens, width]
    modality: str = "image"
    frames: list = field(default_factory=list)  # none: the vision tower is skipped
    processor_kwargs: dict[str, Any] = field(default_factory=dict)  # none apply to given rows
    time_interval: float = 1.0  # M-RoPE temporal step (an image has one temporal patch)
    _hash: str | None = None

    @property
    def processor_options(self) -> dict[str, Any]:
        return self.processor_kwargs

    @property
    def layout(self) -> str:
        return "grid=" + "x".join(map(str, self.grid_thw))

    def content_hash(self) -> str:
        """The rows and the grid: equal rows laid out on another grid get other M-RoPE
        positions, so they must not share KV blocks."""
        if self._hash is None:
            key = f"image_embeds:{self.layout}:{embeds_content_hash(self.embeds)}"
            self._hash = hashlib.sha256(key.encode()).hexdigest()
        return self._hash


def given_image_items(where: str, parsed: ParsedPrompt, merge_size: int, hidden_size: int,
                      deepstack_layers: int) -> list[GivenEmbedsItem]:
    """Check the embeddings and `image_grid_thw` of one prompt; one item per image."""
    where = f"{where}.multi_modal_data"
    fields = parsed.image_embeds_fields
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: got image embedding field(s) {unknown}; expected only {list(_FIELDS)}")
    if "image_grid_thw" not in fields:
        raise ValueError(f"{where}: got image embeddings without 'image_grid_thw'; expected "
                         "{'image_embeds': [tokens, width], 'image_grid_thw': [N, 3]} (the image processor's grid)")
    rows = integer_table(where, "image_grid_thw", fields["image_grid_thw"], "t, h, w")
    for i, (t, h, w) in enumerate(rows):
        if t < 1 or h < 1 or w < 1 or h % merge_size or w % merge_size:
            raise ValueError(f"{where}['image_grid_thw'][{i}]: got {[t, h, w]}; expected positive t, h, w with h "
                             f"and w multiples of spatial_merge_size = {merge_size}")
    counts = [t * h * w // merge_size ** 2 for t, h, w in rows]
    embeds = parsed.image_embeds
    width = (1 + deepstack_layers) * hidden_size
    flat = embeds.reshape(-1, embeds.shape[-1])
    if flat.shape[1] != width or flat.shape[0] != sum(counts):
        what = (f"[{sum(counts)}, {width}]: {sum(counts)} rows = the tokens of image_grid_thw "
                f"({' + '.join(map(str, counts))}), width = hidden_size {hidden_size}")
        if deepstack_layers:
            what += (f" x (1 + {deepstack_layers} DeepStack layers): get_image_features' pooler_output and "
                     "deepstack_features concatenated on the last dimension")
        raise ValueError(f"{where}['image_embeds']: got shape {tuple(embeds.shape)}; expected {what}")
    items, start = [], 0
    for (t, h, w), n in zip(rows, counts):
        items.append(GivenEmbedsItem((t, h, w), n, flat[start:start + n]))
        start += n
    return items
