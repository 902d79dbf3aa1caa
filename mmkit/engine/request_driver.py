"""RequestDriver: the one loop that turns engine steps into per-request results.

`LLM.generate`, `mmkit eval` (`evaluation.run_evaluation`), the Ray rows loop
(`batch_rows.run_rows`) and `AsyncLLMEngine` each add their requests through a driver and
consume its `step()`; so they share one failure policy:
- a request that fails after admission (its image cannot be processed) ends alone: it comes back
  in `DriverStep.errors` and every other request goes on;
- an engine error (the model call raised) propagates from `step()`; the caller ends every
  request it still holds (`abort_all`) and reports the error;
- a request the engine no longer holds but never finished is noticed in the step that loses it
  and comes back in `errors` as a `LostRequestError`, so no caller waits forever;
- `final_only=True` (the default; for callers where no one streams): the engine builds a
  request's `RequestOutput` once, when it finishes, instead of detokenizing every step.

The driver only tracks the ids it added; the engine may serve other callers' requests too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

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
        requests = self.engine.scheduler.requests
        # NOTE: the full scan only when the engine holds fewer requests than are pending here
        # (it holds at least these when none is lost), so a step costs no O(pending) scan.
        lost = [rid for rid in self._pending if rid not in requests] if len(requests) < len(self._pending) else []
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
