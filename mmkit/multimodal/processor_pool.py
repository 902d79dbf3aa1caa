"""Per-item processor work in worker processes: `mm_processor_workers=N` (N >= 1).

The prefetcher (`prefetcher.py`) runs an item's `mm_item_inputs` and content hash off the engine
thread. On threads (the default, `mm_processor_workers=0`) that work shares the engine's GIL:
PIL's resize and the processor's tensor arithmetic release it, but its Python glue does not
(about 40% of a Qwen2-VL 1024x768 image's processor time, measured with a GIL-bound spinner
thread beside it). `ProcessorProcessPool` runs the same call in N processes instead, each with
its own interpreter, so none of it waits for the engine's GIL or holds it.

- Start: the `forkserver` context (a `fork` of the engine would copy its OpenMP and torch
  threads' state); each worker runs torch on one thread, loads the checkpoint's processor once
  (`processor_factory`, a picklable callable: `get_input_processor` with the engine's model
  config) and imports `torch.multiprocessing`, whose reductions send result tensors back in
  shared memory (one copy into a shared segment; a Qwen2-VL 1024x768 item is 18.8 MB of float32
  patches) instead of through the pipe. The workers start when the pool is built, so they load
  while the engine loads its weights.
- Items travel as they are (PIL images pickle their pixels; tensors go through shared memory).
  A worker returns the item's content hash with its inputs; the hash is set on the engine's
  item before its future completes, so the scheduler reads it instead of hashing again.
- Errors: the processor's exception is raised in the engine process with its own type and
  message (the serial path's), where the runner takes the item. A worker that dies (killed,
  out of memory) breaks the pool: its items and every later one fail their requests with the
  reason, and the engine goes on serving requests without images.
- Same function, same pixels: the inputs are identical to the serial path's.
- Shutdown: `shutdown()` (the engine's), or the pool being garbage collected, stops the
  workers; a script that uses the pool needs the `if __name__ == "__main__":` guard, as any
  `forkserver`/`spawn` child re-imports the main module.
"""

from __future__ import annotations

import multiprocessing
import weakref
from concurrent.futures import BrokenExecutor, Future, InvalidStateError, ProcessPoolExecutor
from typing import Any, Callable

_PROCESSOR: Any = None  # in a worker: its input processor, built once by `_start_worker`
_PRELOAD = ("torch", "transformers", "mmkit.processors")


class _ItemFuture(Future):
    """The engine-side future of one item: completes after the item's hash is set, and cancels
    only while the worker has not started it (a cancelled item is computed by the caller)."""

    def __init__(self, remote: Future) -> None:
        super().__init__()
        self._remote = remote

    def cancel(self) -> bool:
        return self._remote.cancel() and super().cancel()


class ProcessorProcessPool:
    """`num_workers` processes running the engine's input processor on items."""

    def __init__(self, processor_factory: Callable[[], Any], num_workers: int) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers: got {num_workers!r}; expected a positive integer")
        self.num_workers = num_workers
        context = multiprocessing.get_context("forkserver")
        # NOTE: the fork server imports torch, transformers and mmkit's processors once and forks
        # every worker from that: ~20 s -> a few s to start them on a loaded 2-core host. Only
        # before the fork server starts (the first forkserver pool of this process) does it apply;
        # "__main__" is the default's entry, kept.
        context.set_forkserver_preload(["__main__", *_PRELOAD])
        self._executor = ProcessPoolExecutor(num_workers, mp_context=context,
                                             initializer=_start_worker, initargs=(processor_factory,))
        # A forkserver/spawn pool starts every worker at its first submit: start them now.
        self._executor.submit(int)
        self._finalizer = weakref.finalize(self, _stop, self._executor)

    def submit(self, item: Any) -> Future:
        """A future of the item's model inputs (or its processor error)."""
        try:
            remote = self._executor.submit(_run, item)
        except BrokenExecutor as exc:
            failed: Future = Future()
            failed.set_exception(_stopped(item, exc))
            return failed
        future = _ItemFuture(remote)

        def done(remote: Future) -> None:
            if remote.cancelled():
                return
            exc = remote.exception()
            try:
                if exc is not None:
                    future.set_exception(_stopped(item, exc) if isinstance(exc, BrokenExecutor) else exc)
                    return
                content_hash, inputs = remote.result()
                if getattr(item, "_hash", None) is None:
                    item._hash = content_hash  # the scheduler's cache key, computed by the worker
                future.set_result(inputs)
            except InvalidStateError:  # cancelled meanwhile: nobody reads it
                pass

        remote.add_done_callback(done)
        return future

    def pids(self) -> list[int]:
        """The worker processes' ids (for tests and diagnostics)."""
        processes = getattr(self._executor, "_processes", None) or {}  # None once shut down
        return sorted(p.pid for p in list(processes.values()) if p.pid)

    def shutdown(self) -> None:
        """Cancel queued items and stop the workers (a running item finishes first; not waited for)."""
        self._finalizer()


def _stopped(item: Any, exc: BaseException) -> RuntimeError:
    """The error of an item whose worker died (killed, out of memory): the pool is broken."""
    where = getattr(item, "where", "") or "an image"
    return RuntimeError(f"{where}: the image processor's worker processes stopped ({exc}); this engine "
                        "cannot prepare images any more: start a new one")


def _stop(executor: ProcessPoolExecutor) -> None:
    executor.shutdown(wait=False, cancel_futures=True)


def _start_worker(processor_factory: Callable[[], Any]) -> None:
    """A worker's start: one torch thread (the engine's threads own the cores), the processor
    loaded once, tensors returned through shared memory."""
    global _PROCESSOR
    import torch
    import torch.multiprocessing as _shared_tensors  # noqa: F401 - registers the tensor reductions

    torch.set_num_threads(1)
    from mmkit.plugins import load_plugins

    load_plugins()  # out-of-tree families register in this process as in the engine's
    _PROCESSOR = processor_factory()


def _run(item: Any) -> tuple[str, Any]:
    return item.content_hash(), _PROCESSOR.mm_item_inputs(item)
