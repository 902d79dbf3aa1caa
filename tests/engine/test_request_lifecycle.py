"""Request state with one owner: the failed-request policy, finished-only outputs,
`RequestOutput.metrics`, and the import direction (nothing below the engine imports it)."""

import ast
from pathlib import Path

import pytest

from conftest import get_llm, make_image
from mmkit import LLM, RequestFailedError, SamplingParams
from mmkit.engine import output_processor

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_image_that_fails_at_scheduling_fails_alone_and_the_others_complete(tiny_ckpt, monkeypatch):
    llm = LLM(str(tiny_ckpt), dtype="float32", max_num_batched_tokens=64)  # several steps of prefill
    bad_image = make_image(7)
    processor = llm.llm_engine.input_processor
    original = processor.mm_item_inputs

    def fails_on_bad_image(item):  # as the image processor does on an image it cannot handle
        if item.source is bad_image:
            raise ValueError("image processor: unsupported image")
        return original(item)

    monkeypatch.setattr(processor, "mm_item_inputs", fails_on_bad_image)
    inputs = [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(1)}}, "Write a haiku.",
              {"prompt": PROMPT, "multi_modal_data": {"image": bad_image}},
              {"prompt": PROMPT, "multi_modal_data": {"image": make_image(2)}}]
    with pytest.raises(RequestFailedError, match=r"1 of 4 prompts failed: inputs\[2\].*unsupported image") as info:
        llm.generate(inputs, GREEDY, use_tqdm=False)
    err = info.value
    assert list(err.failed) == [2] and isinstance(err.failed[2], ValueError)
    assert isinstance(err, RuntimeError) and err.request_ids[2]
    assert err.outputs[2] is None and all(o.finished for i, o in enumerate(err.outputs) if i != 2)
    ref = get_llm(tiny_ckpt).generate([inputs[i] for i in (0, 1, 3)], GREEDY, use_tqdm=False)
    assert token_ids([err.outputs[i] for i in (0, 1, 3)]) == token_ids(ref)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert token_ids(llm.generate(inputs[:2], GREEDY, use_tqdm=False)) == token_ids(ref[:2])  # still usable


def test_generate_builds_one_request_output_per_request(tiny_ckpt, monkeypatch):
    """O(1) output work per token: 256 requests x 256 tokens build 256 RequestOutputs."""
    built = []

    class Counting(output_processor.RequestOutput):
        def __init__(self, request_id, *args, **kwargs):
            built.append(request_id)
            super().__init__(request_id, *args, **kwargs)

    monkeypatch.setattr(output_processor, "RequestOutput", Counting)
    llm = get_llm(tiny_ckpt, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    outs = llm.generate([f"Story number {i}:" for i in range(256)], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 256 for o in outs)
    assert len(built) == 256 and len(set(built)) == 256


def test_request_output_metrics(tiny_ckpt):
    out = get_llm(tiny_ckpt).generate({"prompt": PROMPT, "multi_modal_data": {"image": make_image(3)}},
                                      GREEDY, use_tqdm=False)[0]
    m = out.metrics
    assert m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"] <= m["last_token_time"]
    assert m["last_token_time"] <= m["finished_time"]
    assert m["time_in_queue"] == pytest.approx(m["first_scheduled_time"] - m["arrival_time"])


def test_streamed_outputs_carry_metrics_as_they_fill(tiny_ckpt):
    engine = get_llm(tiny_ckpt).llm_engine
    engine.add_request("metrics-stream", "Hello", SamplingParams(max_tokens=3, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert seen[0].metrics["first_token_time"] is not None and seen[0].metrics["finished_time"] is None
    assert seen[-1].finished and seen[-1].metrics["finished_time"] is not None


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


# The step description is the one engine module below the engine's layers may read: it is the
# scheduler -> runner contract (vLLM's worker reads `sched/output.py` the same way), and it
# imports no other engine module (checked below), so nothing of the engine comes with it.
_STEP_CONTRACT = {"mmkit.engine.scheduler_output", "mmkit.engine.scheduler_output.SchedulerOutput",
                  "mmkit.engine.scheduler_output.CachedSeqData", "mmkit.engine.scheduler_output.NewSeqData",
                  "mmkit.engine.scheduler_output.EncoderInput"}


def _engine_imports(path: Path) -> list[str]:
    return sorted(n for n in _imports(path) if (n == "mmkit.engine" or n.startswith("mmkit.engine."))
                  and n not in _STEP_CONTRACT)


@pytest.mark.parametrize("folder", ["mmkit/worker", "mmkit/layers", "models", "processors"])
def test_nothing_below_the_engine_imports_it(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    offenders = {str(f.relative_to(ROOT)): _engine_imports(f) for f in files}
    assert {f: n for f, n in offenders.items() if n} == {}


def test_the_step_contract_imports_no_engine_module():
    contract = ROOT / "mmkit" / "engine" / "scheduler_output.py"
    assert [n for n in _imports(contract) if n.startswith("mmkit.engine")] == []


class _ForceTokenHook:
    """A stand-in for a grammar matcher: allows one token per sequence, records the calls."""

    def __init__(self, token_id):
        self.token_id, self.new, self.sampled = token_id, [], []

    def on_new_seq(self, state):
        state.sampler_state["force"] = list(state.token_ids[state.num_prompt_tokens:])  # replayed outputs
        self.new.append((state.request_id, len(state.sampler_state["force"])))

    def apply(self, logits, states):
        assert logits.shape[0] == len(states)
        mask = logits.new_full(logits.shape, float("-inf"))
        mask[:, self.token_id] = 0
        logits += mask

    def on_sampled(self, state, token_id):
        state.sampler_state["force"].append(token_id)
        self.sampled.append(token_id)


def test_sampler_hook_sees_every_sequence_and_masks_its_logits(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", seed=0)
    runner = llm.llm_engine.model_runner
    hook = _ForceTokenHook(token_id=42)
    runner.sampler_hooks.append(hook)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    out = llm.generate("Tell me a story", params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [[42] * 4, [42] * 4]
    # Each sample is a request of its own (n > 1 fanned out): both arrive before their first token.
    assert sorted(n for _, n in hook.new) == [0, 0] and sorted(rid[:2] for rid, _ in hook.new) == ["0_", "1_"]
    assert hook.sampled == [42] * 8  # 4 per sample
    # The runner drops finished sequences' states when the next step tells it (vLLM's way).
    old = set(runner.states)
    runner.sampler_hooks.clear()
    llm.generate("Next", SamplingParams(max_tokens=1), use_tqdm=False)
    assert old and not old & set(runner.states)
