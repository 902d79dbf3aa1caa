"""Old import path of the content hashes: items' in `mmkit.multimodal.hashing`, KV blocks' in
`mmkit.engine.block_hashes`."""

from mmkit.engine.block_hashes import block_hash, update_block_hashes
from mmkit.multimodal.hashing import embeds_content_hash, image_content_hash

__all__ = ["block_hash", "update_block_hashes", "embeds_content_hash", "image_content_hash"]
