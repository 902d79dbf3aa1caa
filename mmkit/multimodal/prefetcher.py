"""Overlapped preprocessing: the processor's per-image work runs ahead of scheduling.

Without it the HF image processor (PIL conversion, resize, rescale, normalise) runs on the
engine thread when the scheduler hands an image to the runner, so the forward pass waits
for it. `MultiModalPrefetcher` submits the images of queued requests, in arrival order, to a
small thread pool (or, with `mm_processor_workers=N`, to N processes: `processor_pool.py`) as
soon as they are added, together with their content hash; PIL's decode
and resize, hashlib and numpy's arithmetic release the GIL, so they overlap the model's
matmuls. The runner then takes a finished result instead of computing it. Same function,
same inputs: the pixel values are identical.

Part of the input stage (`stage.py`): `MultiModalInputStage` owns it and is what the scheduler
(a `PreprocessTracker`) and the runner (`mm_item_inputs`) are given at construction.
How the engine uses it:
- `LLM.generate` decodes a call's lazily opened files (`Image.open`) on the workers with
  `map`, before any request is added (a truncated file still fails up front);
- while requests run, a waiting request is admitted only once `is_ready`: the forward pass
  never waits for PIL;
- an idle step (nothing running) `start_now`s every image of the requests it will likely
  admit, past the lookahead, waits for the first request (`wait`: the workers' content
  hashes are then read, not recomputed) and admits the others as they become ready.

Bounded: at most `lookahead` images are in flight or done-but-not-taken (beyond what an idle
step needs at once), so memory stays `lookahead x [3, H, W]` floats however many requests
wait. A slot frees when the runner takes an image, or when its request gets its first token
or ends (an image never taken because the encoder cache already held it); a taken result is
kept until then (a failed step is retried without the processor). A failure inside
a worker is re-raised where the runner takes that image, so it ends only that image's
request (the engine's per-request failure policy). Workers run torch on one OpenMP thread
(see `_one_openmp_thread`).

All bookkeeping happens under one lock; the workers only hash and run `mm_item_inputs`.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, Sequence

from mmkit.multimodal.items import ImageItem
from mmkit.multimodal.processor_pool import ProcessorProcessPool

DEFAULT_NUM_WORKERS = 2

class _Taken:
    """An item the runner took: its result stays until the request's prompt is done, so a
    step that failed and is retried reads it again instead of running the processor."""

    __slots__ = ("future",)

    def __init__(self, future: Future) -> None:
        self.future = future


class MultiModalPrefetcher:
    """Per-item processor work for waiting requests on `num_workers` threads, at most
    `lookahead` items ahead of the runner."""

    def __init__(self, input_processor, lookahead: int, num_workers: int = DEFAULT_NUM_WORKERS,
                 processes: ProcessorProcessPool | None = None) -> None:
        if lookahead < 1:
            raise ValueError(f"preprocess_lookahead: got {lookahead!r}; expected a positive integer")
        self.input_processor = input_processor
        self.lookahead = lookahead
        self.num_workers = num_workers
        self._pool: ThreadPoolExecutor | None = None  # started at first use (items, or `map` only)
        # `mm_processor_workers=N`: the items' processor work runs in these processes instead
        # (processor_pool.py); the threads then only decode files for `map`.
        self.processes = processes
        self._queue: deque[tuple[str, ImageItem]] = deque()  # not yet submitted, arrival order
        # request id -> id(item) -> Future (submitted) or _Taken
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
                if not isinstance(value, _Taken):
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
            return all(isinstance(v, _Taken) or v.done() for v in entries.values())

    def start_now(self, request_ids: Sequence[str]) -> None:
        """Submit these requests' queued items at once, past the lookahead: the scheduler is
        about to admit them together and the step needs them all, so the workers (and the
        engine thread, see `mm_item_inputs`) prepare them side by side, not one by one."""
        wanted = set(request_ids)
        with self._lock:
            if not any(request_id in wanted for request_id, _ in self._queue):
                return
            later: deque[tuple[str, ImageItem]] = deque()
            for request_id, item in self._queue:
                if request_id in wanted:
                    self._submit(request_id, item)
                else:
                    later.append((request_id, item))
            self._queue = later

    def map(self, fn, items: Sequence[Any]):
        """`map(fn, items)` on the worker threads (results in order, the first error raised
        where it is reached): the API decodes a call's lazily opened files with it."""
        if len(items) < 2:
            return map(fn, items)
        with self._lock:
            pool = self._ensure_pool()
        return pool.map(fn, items)

    def wait(self, request_id: str) -> None:
        """Block until the workers finished the request's submitted items (their errors are
        left for `mm_item_inputs` to raise): the scheduler then reads the content hashes
        they computed instead of computing them again on the engine thread."""
        with self._lock:
            entries = self._live.get(request_id)
            futures = [v for v in entries.values() if isinstance(v, Future)] if entries else []
        for future in futures:
            try:
                future.exception()
            except CancelledError:
                pass

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    # ------------------------------------------------------------------ runner side
    def mm_item_inputs(self, request_id: str, item: ImageItem):
        """The item's model inputs: the worker's result (its error re-raised here). The
        scheduler admits a request only once its items are ready, so this does not wait; an
        item that no worker has (its request was never queued here, or a submitted item no
        worker started) is computed on this thread as a last resort, counted in `num_inline`."""
        with self._lock:
            entries = self._live.get(request_id)
            value = entries.get(id(item)) if entries is not None else None
            if isinstance(value, _Taken):  # taken by a step that failed: read it again
                future, inline = value.future, False
            else:
                future = value if isinstance(value, Future) else None
                if future is not None:
                    self._in_flight -= 1
                    self._fill()
                    if future.cancel():  # not started: compute it here rather than wait
                        future = None
                inline = future is None
                if inline:
                    future = Future()
                if entries is not None:
                    entries[id(item)] = _Taken(future)  # never submitted after this point
        if inline:
            self.num_inline += 1
            try:
                future.set_result(self.input_processor.mm_item_inputs(item))
            except Exception as exc:  # noqa: BLE001 - raised below, for this request
                future.set_exception(exc)
        else:
            self.num_prefetched += 1
        return future.result()

    def shutdown(self) -> None:
        with self._lock:
            self._queue.clear()
            for entries in self._live.values():
                for value in entries.values():
                    if not isinstance(value, _Taken):
                        value.cancel()
            self._live.clear()
            self._num_items.clear()
            self._in_flight = 0
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            self.processes.shutdown()

    # ------------------------------------------------------------------ internals
    def _fill(self) -> None:
        """Submit queued items while fewer than `lookahead` are outstanding (lock held)."""
        while self._queue and self._in_flight < self.lookahead:
            request_id, item = self._queue.popleft()
            self._submit(request_id, item)

    def _submit(self, request_id: str, item: ImageItem) -> None:
        """Hand one item to the pool (lock held), unless its request is gone or it was taken."""
        entries = self._live.get(request_id)
        if entries is None or id(item) in entries:
            return
        if self.processes is not None:
            entries[id(item)] = self.processes.submit(item)
        else:
            # NOTE: looked up at call time, so a processor patched after start-up is used.
            entries[id(item)] = self._ensure_pool().submit(self._process, item)
        self._in_flight += 1

    def _ensure_pool(self) -> ThreadPoolExecutor:
        """The worker threads, started at first use (lock held)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="mmkit-preprocess",
                                            initializer=_one_openmp_thread)
        return self._pool

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
    batch-1 decode of the 30-layer benchmark model went from 25 to ~40 ms per step after the
    first image (measured). `torch.set_num_threads` would change the process-wide default
    (every thread started later, e.g. AsyncLLMEngine's, would inherit 1); the OpenMP call
    changes this thread's setting only.
    """
    import torch

    torch.get_num_threads()  # torch's own per-thread set-up first: it would overwrite ours
    # NOTE: every loaded runtime, not one: other wheels (scikit-learn, opencv) bring their own
    # libgomp copies, and which one torch's ops use cannot be told from the path.
    for library in _loaded_openmp_libraries():
        library.omp_set_num_threads(1)


def _loaded_openmp_libraries() -> list[ctypes.CDLL]:
    """The OpenMP runtimes loaded in this process (GNU or Intel); empty where none is found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line or "/libiomp" in line}
    except OSError:
        return []
    libraries = []
    for path in sorted(paths):
        try:
            libraries.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libraries
