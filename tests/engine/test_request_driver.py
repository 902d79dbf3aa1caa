"""The one request driver (mmkit/engine/request_driver.py) that LLM.generate, mmkit eval, the
rows loop, `mmkit caption` and AsyncLLMEngine share: model-free against a scripted engine, and
each caller noticing a request the engine lost."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mmkit.engine.llm_engine import StepResult
from mmkit.engine.request_driver import ErrorPolicy, LostRequestError, RequestDriver, drive
from mmkit.errors import RequestFailedError
from mmkit.sampling_params import SamplingParams


def _out(rid: str, finished: bool):
    return SimpleNamespace(request_id=rid, finished=finished)


class ScriptedEngine:
    """The part of LLMEngine a driver uses; each step plays the next scripted result."""

    def __init__(self, script):
        self.script = list(script)
        self.scheduler = SimpleNamespace(requests={})
        self.added, self.aborted, self.final_only = [], [], {}

    def has_unfinished_request(self, rid):
        return rid in self.scheduler.requests

    def get_num_unfinished_requests(self):
        return len(self.scheduler.requests)

    def add_processed(self, rid, processed, params, *, final_only=False):
        self.scheduler.requests[rid] = processed
        self.added.append(rid)
        self.final_only[rid] = final_only

    def abort_request(self, rids):
        for rid in rids:
            self.scheduler.requests.pop(rid, None)
            self.aborted.append(rid)

    def step_result(self):
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        outputs, errors, drop = step
        for o in outputs:
            if o.finished:
                self.scheduler.requests.pop(o.request_id, None)
        for rid in list(errors) + list(drop):
            self.scheduler.requests.pop(rid)
        return StepResult(outputs, errors)


def test_outputs_errors_and_lost_requests():
    failure = ValueError("bad image")
    engine = ScriptedEngine([
        ([_out("a", False), _out("other", True)], {"b": failure}, []),  # "other" is not this driver's
        ([_out("a", True)], {}, ["c"]),  # the engine drops "c" without a word
    ])
    driver = RequestDriver(engine)
    for rid in "abc":
        driver.add(rid, None, SamplingParams())
    assert engine.final_only == {"a": True, "b": True, "c": True}  # nobody streams: the default
    first = driver.step()
    assert [o.request_id for o in first.outputs] == ["a"] and first.errors == {"b": failure}
    assert driver.pending == {"a", "c"} and first.finished == []
    second = driver.step()
    assert [o.request_id for o in second.finished] == ["a"]
    assert isinstance(second.errors["c"], LostRequestError) and "'c'" in str(second.errors["c"])
    assert driver.pending == frozenset() and len(driver) == 0


def test_an_engine_error_propagates_and_leaving_run_aborts_the_rest():
    engine = ScriptedEngine([RuntimeError("model call failed")])
    driver = RequestDriver(engine)
    driver.add("a", None, SamplingParams(), final_only=False)
    with pytest.raises(RuntimeError, match="model call failed"):
        driver.step()
    assert driver.pending == {"a"}  # the caller decides: every caller ends them
    driver.abort_all()
    assert engine.aborted == ["a"] and not driver.pending
    engine = ScriptedEngine([([_out("a", False)], {}, [])] * 3)
    driver = RequestDriver(engine)
    driver.add("a", None, SamplingParams())
    driver.add("b", None, SamplingParams())
    for _ in driver.run():
        break  # the caller leaves early (an exception, Ctrl-C)
    assert sorted(engine.aborted) == ["a", "b"] and not engine.scheduler.requests


def _admissions(ids, bad=()):
    def prepare(rid):
        if rid in bad:
            raise ValueError(f"inputs: {rid} is bad")
        return rid, SamplingParams()
    return [(rid, lambda rid=rid: prepare(rid)) for rid in ids]


def _collect():
    got = {"out": [], "err": {}}
    return got, got["out"].append, lambda rid, exc: got["err"].__setitem__(rid, exc)


def test_all_or_nothing_validates_every_input_before_adding_any():
    engine = ScriptedEngine([])
    got, on_output, on_error = _collect()
    with pytest.raises(ValueError, match="c is bad"):
        drive(RequestDriver(engine), _admissions("abcd", bad="c"), policy=ErrorPolicy.ALL_OR_NOTHING,
              on_output=on_output, on_error=on_error)
    assert engine.added == [] and got == {"out": [], "err": {}}


def test_all_or_nothing_aborts_the_call_and_raises_an_engine_error():
    engine = ScriptedEngine([([_out("a", True)], {}, []), RuntimeError("model call failed")])
    got, on_output, on_error = _collect()
    with pytest.raises(RuntimeError, match="model call failed"):
        drive(RequestDriver(engine), _admissions("abc"), policy=ErrorPolicy.ALL_OR_NOTHING,
              on_output=on_output, on_error=on_error)
    assert [o.request_id for o in got["out"]] == ["a"] and sorted(engine.aborted) == ["b", "c"]
    assert not engine.scheduler.requests


def test_per_item_records_bad_inputs_and_engine_errors_and_goes_on():
    failure, crash = ValueError("broken image"), RuntimeError("model call failed")
    engine = ScriptedEngine([
        ([_out("a", True)], {"c": failure}, []),  # window 3: a, c, d admitted (b was bad)
        crash,  # d, e, f in flight (e and f admitted after a and c ended) get the engine error
        ([_out("g", True)], {}, []),  # the run goes on with the rest
    ])
    got, on_output, on_error = _collect()
    drive(RequestDriver(engine), _admissions("abcdefg", bad="b"), policy=ErrorPolicy.PER_ITEM, window=3,
          on_output=on_output, on_error=on_error)
    assert [o.request_id for o in got["out"]] == ["a", "g"]
    assert "b is bad" in str(got["err"]["b"]) and got["err"]["c"] is failure
    assert all(got["err"][rid] is crash for rid in "def")
    assert engine.added == list("acdefg") and sorted(engine.aborted) == list("def")


def test_per_item_window_bounds_requests_in_flight():
    engine = ScriptedEngine([([_out(r, True)], {}, []) for r in "abcde"])
    seen = []
    original = engine.add_processed

    def add(rid, *args, **kwargs):
        original(rid, *args, **kwargs)
        seen.append(len(engine.scheduler.requests))

    engine.add_processed = add
    got, on_output, on_error = _collect()
    drive(RequestDriver(engine), _admissions("abcde"), policy=ErrorPolicy.PER_ITEM, window=2,
          on_output=on_output, on_error=on_error)
    assert max(seen) == 2 and [o.request_id for o in got["out"]] == list("abcde")


def test_a_callback_that_raises_aborts_what_is_left():
    engine = ScriptedEngine([([_out("a", True)], {}, [])])
    with pytest.raises(KeyError):
        drive(RequestDriver(engine), _admissions("abc"), policy=ErrorPolicy.PER_ITEM,
              on_output=lambda out: {}["stop"], on_error=lambda rid, exc: None)
    assert sorted(engine.aborted) == ["b", "c"] and not engine.scheduler.requests


def test_dead_engine_is_not_a_drive_policy():
    with pytest.raises(ValueError, match="DEAD_ENGINE is the async engine's own loop"):
        drive(RequestDriver(ScriptedEngine([])), [], policy=ErrorPolicy.DEAD_ENGINE,
              on_output=print, on_error=print)


def _lose_request(monkeypatch, engine, rid: str):
    """Make the scheduler forget `rid` at its next step, as a bookkeeping bug would."""
    original = engine.scheduler.schedule

    def schedule():
        engine.scheduler.requests.pop(rid, None)
        engine.scheduler.waiting = type(engine.scheduler.waiting)(
            s for s in engine.scheduler.waiting if s.group.request_id != rid)
        engine.scheduler.running = [s for s in engine.scheduler.running if s.group.request_id != rid]
        return original()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)


def test_every_caller_notices_a_lost_request(tiny_ckpt, monkeypatch, tmp_path):
    from mmkit import LLM, AsyncLLMEngine
    from mmkit.ray.batch_rows import run_rows

    llm = LLM(str(tiny_ckpt), dtype="float32", max_num_seqs=4)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    # LLM.generate: the batch ends, the lost prompt is a failure of its own.
    start = next(llm._request_counter) + 1  # the call's ids are start, start + 1, start + 2
    _lose_request(monkeypatch, engine, str(start + 1))
    with pytest.raises(RequestFailedError) as info:
        llm.generate(["Hello", "World", "Again"], params, use_tqdm=False)
    assert list(info.value.failed) == [1] and isinstance(info.value.failed[1], LostRequestError)
    assert info.value.outputs[0] is not None and info.value.outputs[2] is not None
    monkeypatch.undo()
    # The rows loop: that row's error column says so, the others complete.
    _lose_request(monkeypatch, engine, "row-0")
    rows = run_rows(llm, [{"prompt": "Hello"}, {"prompt": "World"}], params)
    assert "LostRequestError" in rows[0]["error"] and rows[1]["error"] is None
    monkeypatch.undo()
    # AsyncLLMEngine: the caller's stream raises instead of waiting forever.
    async_engine = AsyncLLMEngine(engine)
    _lose_request(monkeypatch, engine, "lost")

    async def consume():
        try:
            return [o async for o in async_engine.generate("Hello", params, "lost")]
        finally:
            async_engine.shutdown()
            await asyncio.sleep(0.2)  # the worker thread delivers its last job while the loop runs

    with pytest.raises(LostRequestError):
        asyncio.run(asyncio.wait_for(consume(), timeout=60))
    assert not engine.has_unfinished_requests()
