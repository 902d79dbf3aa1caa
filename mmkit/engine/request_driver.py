"""RequestDriver: the one loop that turns engine steps into per-request results, and `drive`, the
one windowed admission loop every caller runs it through.

Who drives, and the error policy each caller gets (`ErrorPolicy`):

| caller                                   | policy           | a bad input                       | an engine error (the model call raised)                 |
|------------------------------------------|------------------|-----------------------------------|---------------------------------------------------------|
| `LLM.generate`/`chat`, `mmkit caption`,  | ALL_OR_NOTHING   | raises before anything is added   | every request of the call is aborted; the error raises  |
| beam search                              |                  |                                   |                                                         |
| `mmkit eval`, Ray rows (`run_rows`)      | PER_ITEM         | that item's result is its error   | every item in flight gets the error; later items run    |
| `AsyncLLMEngine`                         | DEAD_ENGINE      | the caller's `generate` raises    | every waiter gets it; the engine is dead (rebuild it)   |

For every policy:
- a request that fails after admission (its image cannot be processed) ends alone: it comes back
  in `DriverStep.errors` and every other request goes on;
- a request the engine no longer holds but never finished is noticed in the step that loses it
  and comes back in `errors` as a `LostRequestError`, so no caller waits forever;
- leaving early (an exception in a caller's callback, Ctrl-C) aborts what the driver still holds;
- `final_only=True` (the default; for callers where no one streams): the engine builds a
  request's `RequestOutput` once, when it finishes, instead of detokenizing every step.

The async engine adds requests as they arrive, so it steps a `RequestDriver` from its own loop
(`mmkit/engine/async_engine.py`) instead of `drive`; its policy is written there.
The driver only tracks the ids it added; the engine may serve other callers' requests too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from mmkit.outputs import RequestOutput
from mmkit.sampling_params import SamplingParams


class LostRequestError(RuntimeError):
    """The engine stopped holding a request that never finished (an engine bug, reported per
    request instead of a caller waiting forever)."""


@dataclass
class DriverStep:
    """One engine step as seen by one driver: its requests' outputs and failures."""

    outputs: list[RequestOutput]  # progress of this driver's requests (finished ones included)
    errors: dict[str, BaseException]  # request id -> why it ended (failed or lost)

    @property
    def finished(self) -> list[RequestOutput]:
        return [o for o in self.outputs if o.finished]


class RequestDriver:
    """Adds requests to an `LLMEngine` and steps it until they have all ended."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._pending: set[str] = set()

    @property
    def pending(self) -> frozenset[str]:
        """The ids added through this driver that have not ended yet."""
        return frozenset(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request_id: str, processed, params: SamplingParams, *, final_only: bool = True) -> None:
        """Queue a request `LLMEngine.process_request` accepted."""
        self.engine.add_processed(request_id, processed, params, final_only=final_only)
        self._pending.add(request_id)

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._pending]
        self.engine.abort_request(ids)
        self._pending.difference_update(ids)

    def abort_all(self) -> None:
        """End every request of this driver (an engine error, Ctrl-C, a cancelled caller)."""
        self.abort(list(self._pending))

    def step(self) -> DriverStep:
        """One engine step (an engine error propagates, the requests stay pending)."""
        result = self.engine.step_result()
        errors = {rid: exc for rid, exc in result.errors.items() if rid in self._pending}
        outputs = [o for o in result.outputs if o.request_id in self._pending]
        self._pending.difference_update(errors)
        self._pending.difference_update(o.request_id for o in outputs if o.finished)
        engine = self.engine
        # NOTE: the full scan only when the engine holds fewer requests than are pending here
        # (it holds at least these when none is lost), so a step costs no O(pending) scan.
        lost = ([rid for rid in self._pending if not engine.has_unfinished_request(rid)]
                if engine.get_num_unfinished_requests() < len(self._pending) else [])
        for rid in sorted(lost):
            errors[rid] = LostRequestError(f"request {rid!r}: the engine lost it before it finished")
        self._pending.difference_update(lost)
        return DriverStep(outputs, errors)

    def run(self) -> Iterator[DriverStep]:
        """Step until every request of this driver has ended. Leaving early (an exception in the
        caller's loop body, Ctrl-C) ends the remaining ones."""
        completed = False
        try:
            while self._pending:
                yield self.step()
            completed = True
        finally:
            if not completed:
                self.abort_all()


class ErrorPolicy(enum.Enum):
    """What an engine error (the model call raised) does to a caller's requests; see the table
    at the top of this module."""

    ALL_OR_NOTHING = "all_or_nothing"  # abort every request of the call, raise the error
    PER_ITEM = "per_item"  # every request in flight ends with the error; the rest still run
    DEAD_ENGINE = "dead_engine"  # the async engine's: every waiter fails, the engine stays dead


# One admission: a request id and the call that validates and prepares it, returning what
# `RequestDriver.add` takes (what it raises is a bad input: see each policy in `drive`).
Admission = tuple[str, Callable[[], tuple[Any, SamplingParams]]]


def drive(driver: RequestDriver, admissions: Iterable[Admission], *, policy: ErrorPolicy,
          on_output: Callable[[RequestOutput], None], on_error: Callable[[str, BaseException], None],
          window: int | None = None) -> None:
    """Admit requests (at most `window` in flight), step the engine until all have ended, and
    hand each finished output to `on_output` and each failed request to `on_error`.

    ALL_OR_NOTHING prepares every admission before adding any (a bad input raises and leaves
    nothing behind; `window` is ignored) and raises an engine error after aborting the call's
    requests. PER_ITEM prepares each admission as it enters the window (any failure of an item's
    input goes to `on_error`, and the item is never added) and turns an engine error into
    `on_error` for every request in flight, then goes on with the rest.
    """
    if policy is ErrorPolicy.DEAD_ENGINE:
        raise ValueError("drive: DEAD_ENGINE is the async engine's own loop; use ALL_OR_NOTHING or PER_ITEM")
    queue: Iterator[Admission]
    if policy is ErrorPolicy.ALL_OR_NOTHING:
        # Validate everything before adding anything: a bad input leaves no request behind.
        queue = iter([(rid, given(prepare())) for rid, prepare in admissions])
        window = None
    else:
        queue = iter(admissions)
    limit = window if window is not None and window > 0 else None
    exhausted = False
    try:
        while len(driver) or not exhausted:
            while not exhausted and (limit is None or len(driver) < limit):
                admission = next(queue, None)
                if admission is None:
                    exhausted = True
                    break
                rid, prepare = admission
                if policy is ErrorPolicy.PER_ITEM:
                    try:
                        processed, params = prepare()
                    except Exception as exc:  # noqa: BLE001 - any failure of this item's input is its error
                        on_error(rid, exc)
                        continue
                else:
                    processed, params = prepare()
                driver.add(rid, processed, params, final_only=True)
            if not len(driver):
                continue
            try:
                step = driver.step()
            except Exception as exc:  # noqa: BLE001 - the model call failed
                if policy is not ErrorPolicy.PER_ITEM:
                    raise
                in_flight = sorted(driver.pending)
                driver.abort_all()
                for rid in in_flight:
                    on_error(rid, exc)
                continue
            for rid, exc in step.errors.items():
                on_error(rid, exc)
            for out in step.finished:
                on_output(out)
    except BaseException:
        # Includes KeyboardInterrupt: the engine must not keep half a call.
        driver.abort_all()
        raise


def given(value: tuple[Any, SamplingParams]) -> Callable[[], tuple[Any, SamplingParams]]:
    """An admission whose preparation is already done (ALL_OR_NOTHING prepares all up front;
    beam search re-adds prepared beams)."""
    return lambda: value
