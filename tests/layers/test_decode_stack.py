"""The C decode stack (mmkit/layers/decode_stack.py): bit-identical to the per-module path it
replaces, taken exactly where every layer is the plain Llama block on panels, and rebuilt when
the panels are re-bound."""

from __future__ import annotations

import pytest
import torch

from mmkit import LLM, SamplingParams
from mmkit.layers import linear_panels, quant_panels
from mmkit.layers.decode_stack import DecodeStack
from mmkit.testing import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(not linear_panels.available(), reason="no panel kernels (AVX512-BF16 or AVX2) in this build")

ARCHS = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
         "qwen3_vl": "Qwen3VLForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration"}
# prompts of different lengths, so one decode step mixes contexts (and block tables) of several sizes
PROMPTS = ["a cat", "a small cat sat on the mat and looked at the dog by the door for a long time", "hi"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    return {name: build_tiny_checkpoint(arch, root / name) for name, arch in ARCHS.items()}


def _decoder(llm: LLM):
    from mmkit.models.llama import LlamaModel
    model = llm.llm_engine.model_runner.model
    return next(m for m in model.modules() if isinstance(m, LlamaModel))


def _generate(path, monkeypatch, stack: bool, **kw):
    """(token ids, logprobs, how many steps the stack took)."""
    monkeypatch.setenv("MMKIT_DECODE_STACK", "1" if stack else "0")
    taken = []
    run = DecodeStack.run

    def counting(self, *a, **k):
        out = run(self, *a, **k)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(DecodeStack, "run", counting)
    llm = LLM(str(path), seed=0, **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    monkeypatch.undo()
    return ids, logprobs, sum(taken), llm


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None)] + [
    pytest.param("bfloat16", q, marks=pytest.mark.skipif(not quant_panels.available(),
                                                         reason="quantized panels need AVX512-BF16"))
    for q in ("int8", "int4")])
def test_stack_is_bit_identical_to_the_modules(ckpts, monkeypatch, family, dtype, quantization):
    kw = {"dtype": dtype, **({"quantization": quantization} if quantization else {})}
    ids, logprobs, taken, _ = _generate(ckpts[family], monkeypatch, True, **kw)
    ref_ids, ref_logprobs, ref_taken, _ = _generate(ckpts[family], monkeypatch, False, **kw)
    assert ref_taken == 0
    assert taken >= 10, "the decode steps did not go through the C stack"
    assert ids == ref_ids
    assert logprobs == ref_logprobs  # bit-identical: the same kernels on the same data


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_other_blocks_keep_the_modules(ckpts, monkeypatch, family):
    """Qwen3 (q/k norms) and Gemma 3 (its own block) are not the plain Llama block: no stack."""
    _, _, taken, llm = _generate(ckpts[family], monkeypatch, True, dtype="bfloat16")
    assert taken == 0
    assert DecodeStack.build(_decoder(llm)) is None


def test_rebuilt_when_a_projection_is_rebound(ckpts, monkeypatch):
    _, _, _, llm = _generate(ckpts["llava"], monkeypatch, True, dtype="bfloat16")
    decoder = _decoder(llm)
    stack = decoder.decode_stack()
    assert stack is not None and decoder.decode_stack() is stack  # built once per generation
    down = decoder.layers[0].mlp.down_proj
    bound = down._run_panels
    # a projection off the panels (as on a CPU without AVX512-BF16): no stack for the model
    down._run_panels = None
    linear_panels.bump_generation()
    assert decoder.decode_stack() is None
    down._run_panels = bound
    linear_panels.bump_generation()
    rebuilt = decoder.decode_stack()
    assert rebuilt is not None and rebuilt is not stack


def _recording(monkeypatch, steps: list):
    """Record (step has a prefill, the stack took it) for every `DecodeStack.run` call."""
    run = DecodeStack.run

    def recorded(self, x, rope, kv, meta):
        out = run(self, x, rope, kv, meta)
        steps.append((bool(meta.prefills), out is not None))
        return out

    monkeypatch.setattr(DecodeStack, "run", recorded)


def test_prefill_steps_take_the_modules(ckpts, monkeypatch):
    """A step holding a prefill chunk is not a decode-only step: `run` declines it."""
    _, _, _, llm = _generate(ckpts["llava"], monkeypatch, True, dtype="bfloat16")
    steps = []
    _recording(monkeypatch, steps)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert (True, True) not in steps and (False, True) in steps and (True, False) in steps


def test_sliding_window_that_cuts_a_context_falls_back(ckpts, monkeypatch):
    """A layer whose window cuts some context reads other blocks than a global layer: the
    modules run those steps, and the outputs are the per-module path's."""
    _, _, _, llm = _generate(ckpts["llava"], monkeypatch, True, dtype="bfloat16")
    decoder = _decoder(llm)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)

    def run_once():
        out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [{t: lp.logprob for t, lp in s.items()} for s in out.logprobs]

    decoder.layers[0].self_attn.sliding_window = 4
    linear_panels.bump_generation()  # the stack reads the windows when built
    try:
        steps = []
        _recording(monkeypatch, steps)
        got = run_once()
        assert decoder.decode_stack().windows == {4, None}
        assert steps and not any(taken for _, taken in steps)  # every decode context exceeds 4 tokens
        monkeypatch.setenv("MMKIT_DECODE_STACK", "0")
        linear_panels.bump_generation()
        assert run_once() == got
    finally:
        decoder.layers[0].self_attn.sliding_window = None
        linear_panels.bump_generation()


def test_disabled_by_env(ckpts, monkeypatch):
    _, _, _, llm = _generate(ckpts["llava"], monkeypatch, True, dtype="float32")
    monkeypatch.setenv("MMKIT_DECODE_STACK", "0")
    assert DecodeStack.build(_decoder(llm)) is None

