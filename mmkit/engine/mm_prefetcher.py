"""Old import path of the prefetcher: `mmkit.multimodal.prefetcher` (part of the input stage)."""

from mmkit.multimodal.prefetcher import DEFAULT_NUM_WORKERS, MultiModalPrefetcher

__all__ = ["DEFAULT_NUM_WORKERS", "MultiModalPrefetcher"]
