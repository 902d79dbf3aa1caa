"""LoRA adapters on tiny LLaVA against PEFT's PeftModel (applied, not merged), float32 greedy ids."""

from __future__ import annotations

import pytest

from conftest import make_image
from lora_ref import peft_greedy
from mmkit import LLM, LoRARequest, SamplingParams
from mmkit.testing.lora import DECODER_REGEX, build_peft_adapter, rewrite_v4_keys

N = 12
TEXT = "USER: Write a haiku about the sea. ASSISTANT:"
IMG_PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
IMG = make_image(5, 40, 30)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {
        # regex targets: every decoder projection (fused qkv / gate_up in mmkit), LM head, embeddings
        "A": build_peft_adapter(tiny_ckpt, root / "A", seed=11,
                                target_modules=DECODER_REGEX + r"|lm_head|.*embed_tokens"),
        # a list of names (they also name the CLIP tower's q/k/v): the tower excluded by regex
        "B": build_peft_adapter(tiny_ckpt, root / "B", seed=12,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"], exclude_modules=r".*vision_tower.*"),
        # rsLoRA, rank 4, two modules
        "C": build_peft_adapter(tiny_ckpt, root / "C", seed=13, r=4, lora_alpha=8, use_rslora=True,
                                target_modules=r".*language_model.*\.(o_proj|down_proj)"),
    }


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(str(tiny_ckpt), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, seed=0)


def req(adapters, name: str) -> LoRARequest:
    return LoRARequest(f"ad-{name}", ord(name) - ord("A") + 1, str(adapters[name]))


def ids(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def test_one_adapter_with_and_without_image(llm, tiny_ckpt, adapters):
    outs = llm.generate([TEXT, {"prompt": IMG_PROMPT, "multi_modal_data": {"image": IMG}}], greedy(),
                        lora_request=req(adapters, "A"), use_tqdm=False)
    assert ids(outs[0]) == peft_greedy(tiny_ckpt, adapters["A"], TEXT, max_new_tokens=N)
    assert ids(outs[1]) == peft_greedy(tiny_ckpt, adapters["A"], IMG_PROMPT, [IMG], max_new_tokens=N)
    assert ids(outs[0]) != peft_greedy(tiny_ckpt, None, TEXT, max_new_tokens=N)  # the adapter matters


def test_mixed_batch_then_base_unchanged(llm, tiny_ckpt, adapters):
    lora = [req(adapters, "A"), req(adapters, "B"), None, req(adapters, "B")]
    prompts = [TEXT, TEXT, TEXT, {"prompt": IMG_PROMPT, "multi_modal_data": {"image": IMG}}]
    outs = llm.generate(prompts, greedy(), lora_request=lora, use_tqdm=False)
    assert ids(outs[0]) == peft_greedy(tiny_ckpt, adapters["A"], TEXT, max_new_tokens=N)
    assert ids(outs[1]) == peft_greedy(tiny_ckpt, adapters["B"], TEXT, max_new_tokens=N)
    assert ids(outs[2]) == peft_greedy(tiny_ckpt, None, TEXT, max_new_tokens=N)
    assert ids(outs[3]) == peft_greedy(tiny_ckpt, adapters["B"], IMG_PROMPT, [IMG], max_new_tokens=N)
    assert len({tuple(ids(o)) for o in outs[:3]}) == 3
    # After adapters ran, the base model is the base model (with the image too).
    base = llm.generate([TEXT, prompts[3]], greedy(), use_tqdm=False)
    assert ids(base[0]) == peft_greedy(tiny_ckpt, None, TEXT, max_new_tokens=N)
    assert ids(base[1]) == peft_greedy(tiny_ckpt, None, IMG_PROMPT, [IMG], max_new_tokens=N)


def test_third_adapter_evicts_and_reloads(tiny_ckpt, adapters):
    llm = LLM(str(tiny_ckpt), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    manager = llm.llm_engine.model_runner.lora_manager
    names = ["A", "B", "C", "A", None]
    engine = llm.llm_engine
    for i, n in enumerate(names):
        engine.add_request(f"evict-{i}", TEXT, greedy(), lora_request=req(adapters, n) if n else None)
    engine.step()  # the first step admits A, B, A and the base request; C waits for a slot
    assert [s.group.request_id for s in engine.scheduler.running] == ["evict-0", "evict-1", "evict-3", "evict-4"]
    assert [s.group.request_id for s in engine.scheduler.waiting] == ["evict-2"]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    for i, n in enumerate(names):
        want = peft_greedy(tiny_ckpt, adapters[n] if n else None, TEXT, max_new_tokens=N)
        assert ids(finals[f"evict-{i}"]) == want, n
    assert len(manager.slots) == 2 and manager.num_slot_loads >= 3  # C took a slot from A or B
    loads = manager.num_loads
    again = llm.generate(TEXT, greedy(), lora_request=req(adapters, "C"), use_tqdm=False)
    assert ids(again[0]) == peft_greedy(tiny_ckpt, adapters["C"], TEXT, max_new_tokens=N)
    assert manager.num_loads >= loads
    assert len(manager.loaded) <= 2  # max_cpu_loras


def test_prefix_cache_is_per_adapter(llm, tiny_ckpt, adapters):
    long_text = "USER: " + "The quick brown fox jumps over the lazy dog. " * 6 + "ASSISTANT:"
    engine = llm.llm_engine
    hits0 = engine.block_manager.num_cache_hits
    first = llm.generate(long_text, greedy(), lora_request=req(adapters, "A"), use_tqdm=False)
    hits1 = engine.block_manager.num_cache_hits
    second = llm.generate(long_text, greedy(), lora_request=req(adapters, "B"), use_tqdm=False)
    assert engine.block_manager.num_cache_hits == hits1  # nothing of A's blocks reused under B
    third = llm.generate(long_text, greedy(), lora_request=req(adapters, "A"), use_tqdm=False)
    assert engine.block_manager.num_cache_hits > hits1 >= hits0  # A's own blocks are reused
    assert ids(first[0]) == ids(third[0]) == peft_greedy(tiny_ckpt, adapters["A"], long_text, max_new_tokens=N)
    assert ids(second[0]) == peft_greedy(tiny_ckpt, adapters["B"], long_text, max_new_tokens=N)


def test_transformers_4x_key_names(llm, tiny_ckpt, adapters, tmp_path):
    def to_v4(key: str) -> str:
        key = key.replace("base_model.model.model.language_model.", "base_model.model.language_model.model.")
        return key.replace("base_model.model.lm_head.", "base_model.model.language_model.lm_head.")

    v4 = rewrite_v4_keys(adapters["A"], tmp_path / "A_v4", to_v4)
    out = llm.generate(TEXT, greedy(), lora_request=LoRARequest("a-v4", 7, str(v4)), use_tqdm=False)
    assert ids(out[0]) == peft_greedy(tiny_ckpt, adapters["A"], TEXT, max_new_tokens=N)


def test_engine_and_async_engine_paths(llm, tiny_ckpt, adapters):
    import asyncio

    from mmkit import AsyncLLMEngine, EngineArgs

    want = peft_greedy(tiny_ckpt, adapters["B"], TEXT, max_new_tokens=N)
    engine = llm.llm_engine
    engine.add_request("lora-direct", TEXT, greedy(), lora_request=req(adapters, "B"))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert ids(final) == want

    async def run():
        aengine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_ckpt), dtype="float32", enable_lora=True,
                                                             max_lora_rank=8))
        try:
            last = None
            async for out in aengine.generate(TEXT, greedy(), "a1", lora_request=req(adapters, "B")):
                last = out
            return ids(last)
        finally:
            aengine.shutdown()

    assert asyncio.run(run()) == want


def test_decode_stack_keeps_lora_steps(llm, tiny_ckpt, adapters, monkeypatch):
    """Steps with adapters stay in the one-call C decode stack (the deltas are added inside it),
    and the per-module path (MMKIT_DECODE_STACK=0) gives the same ids."""
    from mmkit.layers import cpu_kernels, linear_panels
    from mmkit.models import llama_decode_stack as decode_stack

    if cpu_kernels.library() is None:
        pytest.skip("no C kernels on this host")
    taken = []
    run = decode_stack.DecodeStack.run

    def spy(self, embeds, *args):
        out = run(self, embeds, *args)
        taken.append(out is not None and self.lora_ctx is not None and self.lora_ctx.active)
        return out

    monkeypatch.setattr(decode_stack.DecodeStack, "run", spy)
    lora = [req(adapters, "A"), None, req(adapters, "B")]
    # a prompt of over 128 adapter rows: its prefill splits the deltas over the threads (2 by default)
    long_text = "USER: " + "The quick brown fox jumps over the lazy dog. " * 14 + "ASSISTANT:"
    prompts = [long_text, TEXT, TEXT]
    fast = llm.generate(prompts, greedy(), lora_request=lora, use_tqdm=False)
    if llm.llm_engine.model_runner.model.language_model.decode_stack() is None:
        pytest.skip("the decode stack does not run on this host (no panels)")
    assert taken and all(taken)
    monkeypatch.setenv("MMKIT_DECODE_STACK", "0")
    linear_panels.bump_generation()
    taken.clear()
    slow = llm.generate(prompts, greedy(), lora_request=lora, use_tqdm=False)
    assert not any(taken)
    assert [ids(o) for o in slow] == [ids(o) for o in fast]
    assert ids(fast[0]) == peft_greedy(tiny_ckpt, adapters["A"], long_text, max_new_tokens=N)
    assert ids(fast[2]) == peft_greedy(tiny_ckpt, adapters["B"], TEXT, max_new_tokens=N)
    monkeypatch.delenv("MMKIT_DECODE_STACK")
    linear_panels.bump_generation()


def test_prompt_logprobs_under_an_lm_head_adapter(llm, tiny_ckpt, adapters):
    import torch

    from lora_ref import peft_model

    model, processor = peft_model(str(tiny_ckpt), str(adapters["A"]))
    inputs = processor(text=[TEXT], return_tensors="pt")
    with torch.no_grad():
        ref_lp = model(**inputs).logits[0].log_softmax(-1)
    prompt_ids = inputs["input_ids"][0].tolist()
    outs = llm.generate([TEXT, TEXT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                        lora_request=[req(adapters, "A"), None], use_tqdm=False)
    got = [d[prompt_ids[i]].logprob for i, d in enumerate(outs[0].prompt_logprobs) if i > 0]
    want = [ref_lp[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    base = [d[prompt_ids[i]].logprob for i, d in enumerate(outs[1].prompt_logprobs) if i > 0]
    assert max(abs(a - b) for a, b in zip(base, want)) > 1e-2  # the base row is not the adapter's
