"""The engine's multimodal input stage: from a processed request's items to their model inputs.

Built once by `LLMEngine` and handed to the scheduler and the runner at construction (nothing is
patched in afterwards). The HF processor's per-item work never runs inside `LLMEngine.step()`:
- with prefetching (the default), `add_request` (engine, when a request is queued) starts its
  items' processor work on the prefetcher's workers (threads, or `mm_processor_workers`
  processes: `processor_pool.py`); the scheduler asks `is_ready` / `start_now`
  / `wait` (`PreprocessTracker`) before admitting a request, so an admitted request's items are
  done; `prompt_done` (first token sampled) frees them; a request preempted after that is
  `requeue`d: its items go back to the workers and it is re-admitted, as a new waiting request
  is, only once they are ready again;
- with `async_preprocess=False` (or `preprocess_lookahead=0`) there are no workers: `add_request`
  computes the items' inputs on the calling thread when the request is added (outside `step()`)
  and keeps them until the request ends (a preempted request needs them again), so every
  request counts as ready. The price: every queued request's inputs are held at once.
- the runner takes an item's model inputs with `mm_item_inputs(request_id, item)`: a finished
  result, its error (if the processor raised) re-raised there, failing that request alone;
- `release` (finished, aborted) forgets the request.

The n samples of one user request (fanned out into n scheduler requests, engine/parent_request.py)
share one prompt and so one set of items: the first sample registers them, the others are added
with `shares=<its id>` and read the same results, so the processor runs once per prompt, not once
per sample. The shared results live until every sample's prompt is done (or it ended); a sample
preempted later brings them back with `requeue`, as a lone request does.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Iterable, Sequence

from mmkit.multimodal.inputs import MultiModalKwargs
from mmkit.multimodal.items import MultiModalItem
from mmkit.multimodal.prefetcher import MultiModalPrefetcher
from mmkit.multimodal.processor_pool import ProcessorProcessPool


class MultiModalInputStage:
    """Per-item processor work of the engine's requests, on worker threads when prefetching."""

    def __init__(self, input_processor: Any, lookahead: int, processor_workers: int = 0,
                 processor_factory: Callable[[], Any] | None = None) -> None:
        """`processor_workers` > 0 (needs `lookahead` > 0): the items' processor work runs in that
        many processes, each building its processor with `processor_factory` (picklable)."""
        self.input_processor = input_processor
        processes = None
        if processor_workers > 0:
            if lookahead <= 0 or processor_factory is None:
                raise ValueError("mm_processor_workers needs async_preprocess (and a processor factory)")
            processes = ProcessorProcessPool(processor_factory, processor_workers)
        self.prefetcher: MultiModalPrefetcher | None = (
            MultiModalPrefetcher(input_processor, lookahead, processes=processes) if lookahead > 0 else None)
        # request id -> its items that need the processor, until the request ends (requeue)
        self._items: dict[str, list[MultiModalItem]] = {}
        # Without prefetching: request id -> id(item) -> its inputs, computed when it was added
        self._computed: dict[str, dict[int, Future]] = {}
        # Samples of one prompt: request id -> the id its items are kept under (the first
        # sample's); key -> its live samples, and those whose prompt is not yet computed.
        self._key: dict[str, str] = {}
        self._members: dict[str, set[str]] = {}
        self._prompt_pending: dict[str, set[str]] = {}

    # ------------------------------------------------------------------ engine side
    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> Iterable[Any]:
        """`map` on the workers (the API decodes a call's lazily opened files with it)."""
        return self.prefetcher.map(fn, items) if self.prefetcher is not None else map(fn, items)

    def add_request(self, request_id: str, items: Sequence[MultiModalItem],
                    given_embeds: Sequence[Any] | None = None, *, shares: str | None = None) -> None:
        """A queued request: its items' processor work starts (on the workers), or is done now
        (without them). An item with user-given embeddings (`given_embeds[i]` not None) needs none.
        `shares`: another live request with the same prompt (a sibling sample): this one reads
        its results instead of running the processor again."""
        if given_embeds is not None and not isinstance(given_embeds, (list, tuple)):
            return  # one [N, tokens, hidden] tensor for every item: no processor work
        items = [item for i, item in enumerate(items) if given_embeds is None or given_embeds[i] is None]
        if not items:
            return
        if shares is not None and shares in self._key:
            key = self._key[request_id] = self._key[shares]
            self._members[key].add(request_id)
            self._prompt_pending[key].add(request_id)
            self.requeue(request_id)  # the results may have been freed already
            return
        self._key[request_id] = request_id
        self._members[request_id] = {request_id}
        self._prompt_pending[request_id] = {request_id}
        self._items[request_id] = items
        if self.prefetcher is not None:
            self.prefetcher.add_request(request_id, items)
        else:
            self._computed[request_id] = {id(item): self._compute(item) for item in items}

    def prompt_done(self, request_id: str) -> None:
        """The request's prompt is computed (first token sampled): the workers' results are
        freed once no sibling sample still needs them; they come back with `requeue` if it is
        preempted. Without workers they stay."""
        key = self._key.get(request_id)
        if key is None:
            return
        pending = self._prompt_pending[key]
        pending.discard(request_id)
        if not pending and self.prefetcher is not None:
            self.prefetcher.release(key)

    def requeue(self, request_id: str) -> None:
        """The request was preempted (recompute): if its items' results were freed, they are
        prepared again on the workers, ahead of its re-admission (the scheduler waits for them)."""
        key = self._key.get(request_id)
        if key is None:
            return
        self._prompt_pending[key].add(request_id)
        items = self._items.get(key)
        if self.prefetcher is not None and items and not self.prefetcher.holds(key):
            self.prefetcher.add_request(key, items)

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed): nothing of it is kept once its
        sibling samples ended too."""
        key = self._key.pop(request_id, None)
        if key is None:
            return
        members, pending = self._members[key], self._prompt_pending[key]
        members.discard(request_id)
        pending.discard(request_id)
        if members:
            if not pending and self.prefetcher is not None:
                self.prefetcher.release(key)
            return
        del self._members[key], self._prompt_pending[key]
        self._items.pop(key, None)
        self._computed.pop(key, None)
        if self.prefetcher is not None:
            self.prefetcher.release(key)

    def holds(self, request_id: str) -> bool:
        """Whether the workers hold results (or queued work) of the request."""
        return self.prefetcher is not None and self.prefetcher.holds(self._key_of(request_id))

    def shutdown(self) -> None:
        self._items.clear()
        self._computed.clear()
        self._key.clear()
        self._members.clear()
        self._prompt_pending.clear()
        if self.prefetcher is not None:
            self.prefetcher.shutdown()

    # ------------------------------------------------------------------ scheduler side
    def is_ready(self, request_id: str) -> bool:
        return self.prefetcher is None or self.prefetcher.is_ready(self._key_of(request_id))

    def start_now(self, request_ids: list[str]) -> None:
        if self.prefetcher is not None:
            self.prefetcher.start_now([self._key_of(rid) for rid in request_ids])

    def prepare_now(self, request_ids: list[str]) -> None:
        """Start these requests' items at once (past any lookahead) and wait for them: the
        engine's call before it schedules an idle step."""
        if not request_ids or self.prefetcher is None:
            return
        self.start_now(request_ids)
        for request_id in request_ids:
            if not self.is_ready(request_id):
                self.wait(request_id)

    def wait(self, request_id: str) -> None:
        if self.prefetcher is not None:
            self.prefetcher.wait(self._key_of(request_id))

    @property
    def prefetches(self) -> bool:
        """Whether items are prepared ahead on workers (the scheduler then waits for them)."""
        return self.prefetcher is not None

    # ------------------------------------------------------------------ runner side
    def mm_item_inputs(self, request_id: str, item: MultiModalItem) -> MultiModalKwargs:
        """The item's model inputs for `embed_multimodal` (see the module docstring)."""
        key = self._key_of(request_id)
        if self.prefetcher is not None:
            return self.prefetcher.mm_item_inputs(key, item)
        computed = self._computed.get(key, {}).get(id(item))
        if computed is None:  # pragma: no cover - every processed item was computed at add
            raise RuntimeError(f"request {request_id!r}: an item's inputs were not computed when it was added")
        return computed.result()

    def _key_of(self, request_id: str) -> str:
        return self._key.get(request_id, request_id)

    def _compute(self, item: MultiModalItem) -> Future:
        """The item's inputs now, as a finished future: an error is kept for the runner to
        raise, so it fails this request alone (as a worker's error does)."""
        future: Future = Future()
        try:
            item.content_hash()  # the scheduler's cache keys: hashed here, not in step()
            future.set_result(self.input_processor.mm_item_inputs(item))
        except Exception as exc:  # noqa: BLE001 - re-raised by mm_item_inputs for its request
            future.set_exception(exc)
        return future
