"""Overlapped preprocessing: the processor's per-image work runs ahead of scheduling.

Without it the HF image processor (PIL conversion, resize, rescale, normalise) runs on the
engine thread when the scheduler hands an image to the runner, so the forward pass waits
for it. `MultiModalPrefetcher` submits the images of queued requests, in arrival order, to a
small thread pool as soon as they are added, together with their content hash (so a lazily
opened file is decoded there too); PIL's decode and resize, hashlib and numpy's arithmetic
release the GIL, so they overlap the model's matmuls. The runner then takes a finished result
instead of computing it. Same function, same inputs: the pixel values are identical.

Bounded: at most `lookahead` images are in flight or done-but-not-taken, so memory stays
`lookahead x [3, H, W]` floats however many requests wait. A slot frees when the runner takes
an image, or when its request gets its first token or ends (an image never taken because the
encoder cache already held it). A failure inside a worker is re-raised where the runner takes
that image, so it ends only that image's request (the engine's per-request failure policy).

All bookkeeping happens on the engine thread; the workers only run `mm_item_inputs`.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

from mmkit.inputs import ImageItem

DEFAULT_NUM_WORKERS = 2

_TAKEN = object()  # marker: the runner already consumed (or computed) this item


class MultiModalPrefetcher:
    """Per-item processor work for waiting requests on `num_workers` threads, at most
    `lookahead` items ahead of the runner."""

    def __init__(self, input_processor, lookahead: int, num_workers: int = DEFAULT_NUM_WORKERS) -> None:
        if lookahead < 1:
            raise ValueError(f"preprocess_lookahead: got {lookahead!r}; expected a positive integer")
        self.input_processor = input_processor
        self.lookahead = lookahead
        self.num_workers = num_workers
        self._pool: ThreadPoolExecutor | None = None  # started at the first image
        self._queue: deque[tuple[str, ImageItem]] = deque()  # not yet submitted, arrival order
        # request id -> id(item) -> Future (submitted) or _TAKEN
        self._live: dict[str, dict[int, Any]] = {}
        self._num_items: dict[str, int] = {}  # request id -> its number of items
        self._in_flight = 0  # submitted, neither taken nor released
        self._lock = threading.Lock()  # add/take/release may come from different threads (AsyncLLMEngine)
        self.num_prefetched = 0  # results taken from a worker (for tests/metrics)
        self.num_inline = 0  # items computed on the calling thread (not submitted in time)

    # ------------------------------------------------------------------ engine side
    def add_request(self, request_id: str, items: Sequence[ImageItem]) -> None:
        if not items:
            return
        with self._lock:
            self._live[request_id] = {}
            self._num_items[request_id] = len(items)
            self._queue.extend((request_id, item) for item in items)
            self._fill()

    def release(self, request_id: str) -> None:
        """The request no longer needs its images (first token sampled, finished, aborted)."""
        with self._lock:
            entries = self._live.pop(request_id, None)
            self._num_items.pop(request_id, None)
            if not entries:
                return
            for value in entries.values():
                if value is not _TAKEN:
                    value.cancel()  # a result nobody will read; cancelled if not started
                    self._in_flight -= 1
            self._fill()

    def holds(self, request_id: str) -> bool:
        return request_id in self._live

    def is_ready(self, request_id: str) -> bool:
        """Whether every image of the request has been prepared (or taken, or never was
        the prefetcher's): the scheduler admits a request early only when it is."""
        with self._lock:
            entries = self._live.get(request_id)
            if entries is None:
                return True
            if len(entries) < self._num_items[request_id]:
                return False  # some still queued behind the lookahead
            return all(v is _TAKEN or v.done() for v in entries.values())

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    # ------------------------------------------------------------------ runner side
    def mm_item_inputs(self, request_id: str, item: ImageItem):
        """The item's model inputs: the worker's result if it was submitted (its error
        re-raised here), else computed now on this thread."""
        with self._lock:
            entries = self._live.get(request_id)
            value = entries.get(id(item)) if entries is not None else None
            if entries is not None:
                entries[id(item)] = _TAKEN  # never submitted after this point
            future = value if isinstance(value, Future) else None
            if future is not None:
                self._in_flight -= 1
                self._fill()
        if future is None:
            self.num_inline += 1
            return self.input_processor.mm_item_inputs(item)
        self.num_prefetched += 1
        return future.result()

    def shutdown(self) -> None:
        with self._lock:
            self._queue.clear()
            for entries in self._live.values():
                for value in entries.values():
                    if value is not _TAKEN:
                        value.cancel()
            self._live.clear()
            self._num_items.clear()
            self._in_flight = 0
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _fill(self) -> None:
        """Submit queued items while fewer than `lookahead` are outstanding (lock held)."""
        while self._queue and self._in_flight < self.lookahead:
            request_id, item = self._queue.popleft()
            entries = self._live.get(request_id)
            if entries is None or id(item) in entries:  # request gone, or item already taken
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="mmkit-preprocess",
                                                initializer=_one_openmp_thread)
            # NOTE: looked up at call time, so a processor patched after start-up is used.
            entries[id(item)] = self._pool.submit(self._process, item)
            self._in_flight += 1

    def _process(self, item: ImageItem):
        # The scheduler needs the item's content hash (cache keys) before the runner needs its
        # pixels; computing it here first takes the file decode and the SHA-256 of the pixels
        # off the engine thread as well (the item keeps it).
        item.content_hash()
        return self.input_processor.mm_item_inputs(item)


def _one_openmp_thread() -> None:
    """Run on each worker thread at its start: its torch ops use this thread only.

    NOTE: a thread that enters an OpenMP parallel region (the processor's tensor copies do)
    gets its own team of OpenMP threads. With more OpenMP threads than CPUs, libgomp cuts
    every team's spin-wait to a short "throttled" count, so the model's own team falls asleep
    between parallel regions and each of a decode step's ~120 matmuls pays a futex wake-up:
    batch-1 decode of the 30-layer benchmark LLaVA went from 25 to ~40 ms per step after the
    first image (measured). `torch.set_num_threads` would change the process-wide default
    (every thread started later, e.g. AsyncLLMEngine's, would inherit 1); the OpenMP call
    changes this thread's setting only.
    """
    import torch

    torch.get_num_threads()  # torch's own per-thread set-up first: it would overwrite ours
    library = _loaded_openmp_library()
    if library is not None:
        library.omp_set_num_threads(1)


def _loaded_openmp_library() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (GNU or Intel), or None where it cannot be found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line or "/libiomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None
