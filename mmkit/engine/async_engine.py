"""AsyncLLMEngine: a background loop over `LLMEngine` that streams `RequestOutput`s.

The loop lives in the caller's event loop (started lazily on the first `generate`); the
engine has one owner thread, a daemon worker: request processing (tokenizing, placeholder
expansion, grammar compilation, which may register a sampler hook with the runner), adding,
aborting and every step run there, one job at a time, so the event loop stays responsive
while the model computes, the engine is never touched by two threads, and nothing keeps the
interpreter from exiting. The event loop owns only the streams and the pending lists it hands
to the worker with each job.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, AsyncIterator, Callable

from mmkit.config import EngineArgs
from mmkit.engine.llm_engine import LLMEngine
from mmkit.engine.request_driver import RequestDriver
from mmkit.errors import EngineDeadError
from mmkit.multimodal.parse import parse_prompt
from mmkit.outputs import RequestOutput
from mmkit.sampling_params import SamplingParams

_END = object()  # stream sentinel: the request was aborted


class _StepWorker:
    """One daemon thread that runs engine steps for the event loop."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="mmkit-engine", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, loop, future = job
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting loop
                _deliver_to(loop, _set_exception, future, exc)
            else:
                _deliver_to(loop, _set_result, future, result)

    def run(self, fn: Callable[[], Any]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((fn, loop, future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)


def _deliver_to(loop: asyncio.AbstractEventLoop, setter: Callable, future: asyncio.Future, value: Any) -> None:
    # NOTE: the loop that submitted the job may have closed meanwhile (an `asyncio.run` that
    # ended while its last job ran): nobody awaits the result, and the thread must live on for
    # the next loop that uses the engine.
    try:
        loop.call_soon_threadsafe(setter, future, value)
    except RuntimeError:
        pass


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class AsyncLLMEngine:
    """`async for out in engine.generate(inputs, params, request_id)` streams cumulative outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # The one request driver (mmkit/engine/request_driver.py), used on the worker thread only.
        self._driver = RequestDriver(engine)
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending_adds: list[tuple[str, Any, SamplingParams]] = []
        self._pending_aborts: set[str] = set()
        self._worker: _StepWorker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._dead: BaseException | None = None
        self._shutdown = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_engine_args(engine_args))

    # ------------------------------------------------------------------ public API
    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def errored(self) -> bool:
        return self._dead is not None

    async def generate(self, inputs: Any, sampling_params: SamplingParams | None,
                       request_id: str, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Add one request and yield its progress; the last output has `finished=True`.

        Leaving the loop early or cancelling the task aborts the request.
        """
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use by an unfinished request")
        parsed = parse_prompt(0, inputs)
        self._ensure_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream  # the id is taken while the request is processed
        finished = False
        try:
            # Validation runs on the engine's thread (between steps), so a bad input raises to
            # this caller only and the event loop never runs the processor.
            try:
                processed, params = await self._worker.run(
                    lambda: self.engine.process_request(request_id, parsed, sampling_params, lora_request))
            except BaseException:
                finished = True
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]
                raise
            if self._streams.get(request_id) is not stream:  # aborted or shut down meanwhile
                finished = True
                item = stream.get_nowait() if not stream.empty() else _END
                if isinstance(item, BaseException):
                    raise item
                return
            self._pending_adds.append((request_id, processed, params))
            self._wakeup.set()
            while True:
                item = await stream.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def shutdown(self) -> None:
        """Stop the background loop and its worker thread."""
        self._shutdown = True
        self.engine.input_stage.shutdown()
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError("the engine was shut down"))
        self._streams.clear()

    async def add_lora(self, lora_request: Any) -> None:
        """Load and check an adapter (vLLM's name) on the engine's thread, between steps;
        ValueError naming the cause."""
        self._check_alive()
        self._ensure_loop()
        await self._worker.run(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        self._check_alive()
        self._ensure_loop()
        return await self._worker.run(lambda: self.engine.remove_lora(lora_int_id))

    async def get_metrics(self) -> dict[str, int]:
        if self._worker is None or not self.is_running:
            return self.engine.get_metrics()
        return await self._worker.run(self.engine.get_metrics)  # read between steps, on its thread

    # ------------------------------------------------------------------ internals
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop failed earlier ({self._dead!r}); rebuild the engine") \
                from self._dead
        if self._shutdown:
            raise EngineDeadError("the engine was shut down")

    def _abort_now(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.put_nowait(_END)
        self._pending_aborts.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self.is_running:
            return
        self._loop = loop
        self._wakeup = asyncio.Event()
        if self._worker is None:
            self._worker = _StepWorker()
        self._loop_task = loop.create_task(self._run_loop(), name="mmkit-engine-loop")

    def _take_pending(self) -> tuple[list, set[str]]:
        """On the event loop: the adds still wanted and the aborts, handed to the next job."""
        adds, self._pending_adds = self._pending_adds, []
        aborts, self._pending_aborts = self._pending_aborts, set()
        adds = [a for a in adds if a[0] not in aborts and a[0] in self._streams]
        return adds, aborts

    def _engine_job(self, adds: list, aborts: set[str]):
        """On the worker thread: apply the pending requests, then one step if any is left."""
        driver = self._driver
        for request_id, processed, params in adds:
            driver.add(request_id, processed, params, final_only=False)  # streamed: every step's output
        driver.abort(aborts)
        return driver.step() if driver.pending or self.engine.has_unfinished_requests() else None

    async def _run_loop(self) -> None:
        try:
            while not self._shutdown:
                self._wakeup.clear()
                adds, aborts = self._take_pending()
                step = await self._worker.run(lambda: self._engine_job(adds, aborts))
                if step is None:  # nothing to run: sleep until a request arrives or is aborted
                    if not (self._pending_adds or self._pending_aborts):
                        await self._wakeup.wait()
                    continue
                self._fail_requests(step.errors)
                self._deliver(step.outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear of it
            self._dead = exc
            error = EngineDeadError(f"the engine loop failed: {exc!r}")
            error.__cause__ = exc
            for stream in self._streams.values():
                stream.put_nowait(error)
            self._streams.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_requests(self, errors: dict[str, BaseException]) -> None:
        """Errors that belong to some requests (e.g. an image that fails to load, or a request
        the engine lost): those requests have ended in the engine; their callers get the error."""
        for rid, exc in errors.items():
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put_nowait(exc)
