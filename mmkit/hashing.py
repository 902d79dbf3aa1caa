"""Content hashes: images (for the encoder cache and prefix-cache keys) and KV blocks."""

from __future__ import annotations

import hashlib

import torch

from mmkit.inputs import ImageItem


def image_content_hash(item: ImageItem) -> str:
    """Hash of the pixels as the image processor will see them (not of a file name).

    A float tensor, the equal uint8 tensor and the equal PIL image hash alike.
    """
    img = item.to_pil()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()


def embeds_content_hash(embeds: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"embeds:{tuple(embeds.shape)}:{embeds.dtype}:".encode())
    h.update(embeds.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def block_hash(parent: int | None, token_ids: tuple[int, ...], extra: tuple) -> int:
    """A full block's key: its parent's hash, its tokens and the images it covers."""
    return hash((parent, token_ids, extra))


def update_block_hashes(seq, block_size: int) -> None:
    """Extend `seq.block_hashes` to every full block of its tokens."""
    group = seq.group
    ranges = group.processed.placeholder_ranges
    num_full = seq.num_tokens // block_size
    hashes = seq.block_hashes
    while len(hashes) < num_full:
        i = len(hashes)
        start, end = i * block_size, (i + 1) * block_size
        extra = ()
        if ranges:
            image_hashes = group.get_image_hashes()
            extra = tuple((image_hashes[j], max(start, off) - off)
                          for j, (off, length) in enumerate(ranges) if off < end and start < off + length)
        parent = hashes[-1] if hashes else None
        hashes.append(block_hash(parent, tuple(seq.token_ids[start:end]), extra))
