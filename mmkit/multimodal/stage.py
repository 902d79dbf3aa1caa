"""The engine's multimodal input stage: from a processed request's items to their model inputs.

Built once by `LLMEngine` and handed to the scheduler and the runner at construction (nothing is
patched in afterwards):
- `add_request` (engine, when a request is queued) starts its items' processor work on the
  prefetcher's workers, `release` ends it (first token sampled, finished, aborted);
- the scheduler asks `is_ready` / `start_now` / `wait` (`PreprocessTracker`) before admitting a
  request, so a step's forward pass does not wait for PIL;
- the runner takes an item's model inputs with `mm_item_inputs(request_id, item)`: a worker's
  finished result (its error re-raised there, failing that request alone).

With `async_preprocess=False` (or `preprocess_lookahead=0`) there is no prefetcher: the
processor's per-item work runs where the runner asks for it, on the engine thread, and every
request counts as ready.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from mmkit.models.interfaces import MultiModalKwargs
from mmkit.multimodal.items import MultiModalItem
from mmkit.multimodal.prefetcher import MultiModalPrefetcher


class MultiModalInputStage:
    """Per-item processor work of the engine's requests, on worker threads when prefetching."""

    def __init__(self, input_processor: Any, lookahead: int) -> None:
        self.input_processor = input_processor
        self.prefetcher: MultiModalPrefetcher | None = (
            MultiModalPrefetcher(input_processor, lookahead) if lookahead > 0 else None)

    # ------------------------------------------------------------------ engine side
    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> Iterable[Any]:
        """`map` on the workers (the API decodes a call's lazily opened files with it)."""
        return self.prefetcher.map(fn, items) if self.prefetcher is not None else map(fn, items)

    def add_request(self, request_id: str, items: Sequence[MultiModalItem], has_embeds: bool) -> None:
        """A queued request: its items' processor work starts (user embeddings need none)."""
        if self.prefetcher is not None and items and not has_embeds:
            self.prefetcher.add_request(request_id, items)

    def release(self, request_id: str) -> None:
        """The request no longer needs its items' model inputs."""
        if self.prefetcher is not None:
            self.prefetcher.release(request_id)

    def holds(self, request_id: str) -> bool:
        return self.prefetcher is not None and self.prefetcher.holds(request_id)

    def shutdown(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.shutdown()

    # ------------------------------------------------------------------ scheduler side
    def is_ready(self, request_id: str) -> bool:
        return self.prefetcher is None or self.prefetcher.is_ready(request_id)

    def start_now(self, request_ids: list[str]) -> None:
        if self.prefetcher is not None:
            self.prefetcher.start_now(request_ids)

    def wait(self, request_id: str) -> None:
        if self.prefetcher is not None:
            self.prefetcher.wait(request_id)

    @property
    def prefetches(self) -> bool:
        """Whether items are prepared ahead on workers (the scheduler then waits for them)."""
        return self.prefetcher is not None

    # ------------------------------------------------------------------ runner side
    def mm_item_inputs(self, request_id: str, item: MultiModalItem) -> MultiModalKwargs:
        """The item's model inputs for `embed_multimodal` (see the module docstring)."""
        if self.prefetcher is not None:
            return self.prefetcher.mm_item_inputs(request_id, item)
        return self.input_processor.mm_item_inputs(item)
