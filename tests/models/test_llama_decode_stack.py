"""The C decoder stack (models/llama_decode_stack.py): bit-identical to the per-module path it
replaces, on decode steps and on steps with prefill chunks (chunked, and mixed with decodes),
taken exactly where every layer is the plain Llama block on panels, and rebuilt when the panels
are re-bound."""

from __future__ import annotations

import ctypes

import pytest
import torch

from mmkit import LLM, SamplingParams
from mmkit.layers import cpu_kernels, linear_panels, quant_panels
from mmkit.models.llama_decode_stack import DecodeStack, _Step
from mmkit.testing import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(not linear_panels.available(), reason="no panel kernels (AVX512-BF16 or AVX2) in this build")

ARCHS = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
         "qwen3_vl": "Qwen3VLForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration"}
# prompts of different lengths, so one decode step mixes contexts (and block tables) of several sizes
PROMPTS = ["a cat", "a small cat sat on the mat and looked at the dog by the door for a long time", "hi"]


@pytest.fixture(autouse=True, scope="module")
def panels_take_every_row():
    """On AMX hosts a bf16 `Linear` sends calls above 2 rows to oneDNN (linear_panels.BF16_MAX_ROWS),
    so no step of 3+ rows would reach the stack there; these tests check the stack itself, so the
    panels take every row (a module-wide patch: the tests' own monkeypatch.undo() keeps it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(linear_panels, "BF16_MAX_ROWS", None)
        yield


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_warming_changes_no_bit(ckpts, monkeypatch, dtype):
    """The MLP's GEMMs warm the next layer's K/V by default (MMKIT_KV_WARM, csrc/kv_warm.h: prefetches
    threaded through the GEMMs' inner loops); with it off the stack gives the same bits."""
    ids, logprobs, taken, _ = _generate(ckpts["llava"], monkeypatch, True, dtype=dtype)
    monkeypatch.setenv("MMKIT_KV_WARM", "0")
    off_ids, off_logprobs, off_taken, _ = _generate(ckpts["llava"], monkeypatch, True, dtype=dtype)
    assert taken >= 10 and off_taken >= 10
    assert (ids, logprobs) == (off_ids, off_logprobs)


def _warm_offsets(lens, block_ids, *, starts=None, tiles=None, kv_warm=1, dtype=torch.bfloat16, head_dim=64,
                  block_size=16, kv_heads=2, num_blocks=64):
    """The C stack's K/V warming list for a step (csrc/decode_stack_cpu.c, kv_warm_offsets)."""
    lens_t = torch.tensor(lens, dtype=torch.long)
    ids = torch.tensor(block_ids, dtype=torch.long)
    starts_t = torch.tensor(starts, dtype=torch.long) if starts is not None else None
    tiles_t = torch.tensor(tiles, dtype=torch.long) if tiles is not None else None
    step = _Step(num_tokens=len(lens), num_heads=kv_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                 num_blocks=num_blocks, block_size=block_size, max_blocks=ids.shape[1], block_ids=ids.data_ptr(),
                 context_lens=lens_t.data_ptr(), context_starts=starts_t.data_ptr() if starts is not None else None,
                 tiles=tiles_t.data_ptr() if tiles is not None else None, dtype=cpu_kernels._DTYPES[dtype],
                 kv_warm=kv_warm)
    out = (ctypes.c_int64 * 4096)()
    n = cpu_kernels.library().mmkit_decode_stack_warm_offsets(ctypes.byref(step), out, 4096)
    assert n <= 4096
    return list(out[:n])


def test_kv_warming_lists_each_context_block_per_kv_head():
    """The list the MLP's GEMMs warm: every block a decode row's context reads, per sequence, KV
    head and block in attention's order, as byte offsets into a layer's cache; none before a
    sliding window's start, none for steps with prefill tiles or with the switch off; cut at
    16 MiB of K + V."""
    ids = [[5, 9, 0], [7, 3, 11]]
    block = 16 * 64 * 2  # bf16 block of one KV head
    expect = [(h * 64 + b) * block for h in (0, 1) for b in (5,)] + \
             [(h * 64 + b) * block for h in (0, 1) for b in (7, 3, 11)]
    assert _warm_offsets([16, 40], ids) == expect
    assert _warm_offsets([16, 40], ids, starts=[0, 20]) == \
        [(h * 64 + 5) * block for h in (0, 1)] + [(h * 64 + b) * block for h in (0, 1) for b in (3, 11)]
    assert _warm_offsets([16, 40], ids, kv_warm=0) == []
    assert _warm_offsets([16, 40], ids, tiles=[0, 1, 2]) == []
    float32 = _warm_offsets([16, 40], ids, dtype=torch.float32)
    assert float32 == [o * 2 for o in expect]
    # 16 MiB of K + V at 64 KiB a block (head_dim 2048 in float32, 8 tokens): 128 offsets at the most
    big = _warm_offsets([8 * 200], [list(range(200))], kv_heads=1, head_dim=2048, block_size=8, dtype=torch.float32,
                        num_blocks=200)
    assert len(big) == 128 and big == [b * 8 * 2048 * 4 for b in range(128)]


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
    """Record (step has a prefill, step has decode rows, the stack took it) for every
    `DecodeStack.run` call."""
    run = DecodeStack.run

    def recorded(self, x, rope, kv, meta):
        out = run(self, x, rope, kv, meta)
        steps.append((bool(meta.prefills), meta.num_decode_tokens > 0, out is not None))
        return out

    monkeypatch.setattr(DecodeStack, "run", recorded)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_and_mixed_prefill_steps_take_the_stack(ckpts, monkeypatch, dtype):
    """A 12-token budget splits the long prompt into chunks (a later chunk attends to the
    cached earlier ones) and puts the short prompts' decodes in the same steps: the stack takes
    those steps, with the per-module path's ids and logprobs."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run(stack: bool):
        monkeypatch.setenv("MMKIT_DECODE_STACK", "1" if stack else "0")
        llm = LLM(str(ckpts["llava"]), seed=0, dtype=dtype, max_num_batched_tokens=12)
        steps = []
        _recording(monkeypatch, steps)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        monkeypatch.undo()
        return ([list(o.outputs[0].token_ids) for o in outs],
                [[{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs] for o in outs], steps)

    ids, logprobs, steps = run(True)
    ref_ids, ref_logprobs, ref_steps = run(False)
    assert not any(taken for _, _, taken in ref_steps)
    assert (True, True, True) in steps, "no step with a prefill chunk and decode rows went through the stack"
    assert (True, False, True) in steps and (False, True, True) in steps
    assert all(taken for _, _, taken in steps)
    assert ids == ref_ids
    assert logprobs == ref_logprobs


def test_prefill_with_sdpa_takes_the_modules(ckpts, monkeypatch):
    """With the paged prefill kernel off (MMKIT_PAGED_PREFILL=0) prefill chunks go to SDPA in
    the modules, so the stack declines those steps and still takes the decode-only ones."""
    from mmkit.layers import attention
    _, _, _, llm = _generate(ckpts["llava"], monkeypatch, True, dtype="bfloat16")
    steps = []
    _recording(monkeypatch, steps)
    monkeypatch.setattr(attention, "_PAGED_PREFILL", False)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert (False, True, True) in steps
    assert not any(taken for prefill, _, taken in steps if prefill)


def test_scratch_is_kept_between_steps_up_to_its_cap(ckpts, monkeypatch):
    from mmkit.models import llama_decode_stack as decode_stack
    _, _, _, llm = _generate(ckpts["llava"], monkeypatch, True, dtype="float32")
    stack = _decoder(llm).decode_stack()
    kept = stack._work
    assert kept is not None and stack._scratch(kept.numel()) is kept  # reused, not allocated again
    grown = stack._scratch(kept.numel() + 1)
    assert grown.numel() == kept.numel() + 1 and stack._work is grown
    monkeypatch.setattr(decode_stack, "KEEP_WORK_BYTES", grown.numel())
    big = stack._scratch(grown.numel() + 1)  # past the cap: this step's own buffer
    assert big is not grown and stack._work is grown


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
        assert steps and not any(taken for _, _, taken in steps)  # every context exceeds 4 tokens
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

