"""Prefix-cache keys of KV blocks (an item's own content hash is `mmkit/multimodal/hashing.py`'s).

SHA-256 over bytes with a fixed layout (little-endian integers): the same content gives
the same key in every process and on every machine (Ray replicas, restarts), unlike
Python's salted `hash()`, and keys cannot be collided on purpose (vLLM moved its prefix
cache to SHA-256 for CVE-2025-25183).
"""

from __future__ import annotations

import hashlib
import struct


_ROOT = bytes(32)  # the parent of a sequence's first block


def block_hash(parent: bytes | None, token_ids: tuple[int, ...] | list[int],
               extra: tuple[tuple[str, int], ...]) -> bytes:
    """A full block's key (32 bytes): its parent's key, its tokens and, per image it covers,
    the image's content hash and the offset into the image."""
    h = hashlib.sha256(parent or _ROOT)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for image_hash, offset in extra:
        h.update(struct.pack("<I", len(image_hash)) + image_hash.encode() + struct.pack("<q", offset))
    return h.digest()


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
        # A chain computed under a LoRA adapter starts from the adapter's tag (never shared with B).
        lora = getattr(group.processed, "lora_request", None)
        parent = hashes[-1] if hashes else (lora.cache_tag() if lora is not None else None)
        hashes.append(block_hash(parent, seq.token_ids[start:end], extra))
