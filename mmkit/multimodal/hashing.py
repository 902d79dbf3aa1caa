"""Content hashes of a prompt's items: the encoder-cache keys, and what the prefix-cache keys
of the blocks an item covers hold (`mmkit/engine/block_hashes.py`).

SHA-256 over bytes with a fixed layout: the same content gives the same key in every process
and on every machine (Ray replicas, restarts), unlike Python's salted `hash()`.
"""

from __future__ import annotations

import hashlib

import torch

from mmkit.multimodal.items import MultiModalItem


def image_content_hash(item: MultiModalItem) -> str:
    """Hash of the pixels as the image processor will see them (see `ImageItem.content_hash`)."""
    return item.content_hash()


def embeds_content_hash(embeds: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(f"embeds:{tuple(embeds.shape)}:{embeds.dtype}:".encode())
    h.update(embeds.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
