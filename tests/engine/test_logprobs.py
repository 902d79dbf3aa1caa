"""Sample and prompt logprobs against transformers' own forward pass (float32, CPU)."""

import math

import pytest
import torch

from conftest import _hf_model, get_llm, make_image
from mmkit import SamplingParams

PROMPT = "USER: <image>\nDescribe the image in detail. ASSISTANT:"


def hf_logprobs(ckpt, prompt, image, full_ids):
    """log_softmax of the HF model's logits at every position of `full_ids` (prompt + output)."""
    model, processor = _hf_model(str(ckpt))
    inputs = processor(text=prompt, images=image, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([full_ids]), pixel_values=inputs["pixel_values"],
                       attention_mask=torch.ones(1, len(full_ids), dtype=torch.long)).logits[0]
    return inputs["input_ids"][0].tolist(), logits.float().log_softmax(-1)


def check_position(entry, ref_lp, actual_id, k, tokenizer, sampled_rank=None):
    """One position's dict: the top-k (ranks 1..k, sorted) plus the actual token."""
    assert actual_id in entry
    top = torch.topk(ref_lp, k)
    for rank, tid in enumerate(top.indices.tolist()[:k], start=1):
        assert tid in entry, (tid, entry.keys())
        assert entry[tid].rank == rank
    assert len(entry) in (k, k + 1)
    if len(entry) == k + 1:
        assert entry[actual_id].rank > k
    ranked = sorted((lp.rank, tid) for tid, lp in entry.items())
    ordered = [entry[tid].logprob for _, tid in ranked]
    assert ordered == sorted(ordered, reverse=True)
    for tid, lp in entry.items():
        assert lp.logprob == pytest.approx(float(ref_lp[tid]), abs=1e-4)
        assert lp.decoded_token == tokenizer.decode([tid])
        assert lp.rank == int((ref_lp > ref_lp[tid]).sum()) + 1 or abs(
            float(ref_lp[tid]) - float(torch.sort(ref_lp, descending=True).values[lp.rank - 1])) < 1e-5
    if sampled_rank is not None:
        assert entry[actual_id].rank == sampled_rank


def test_greedy_logprobs_and_prompt_logprobs_match_hf(tiny_ckpt):
    llm = get_llm(tiny_ckpt)
    tok = llm.get_tokenizer()
    image = make_image(11)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    comp = out.outputs[0]
    full = out.prompt_token_ids + comp.token_ids
    hf_prompt_ids, ref = hf_logprobs(tiny_ckpt, PROMPT, image, full)
    assert hf_prompt_ids == out.prompt_token_ids
    n_prompt = len(out.prompt_token_ids)

    # Generated tokens: position n_prompt + j is predicted by the logits at n_prompt + j - 1.
    assert len(comp.logprobs) == len(comp.token_ids) == 12
    for j, (tid, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        check_position(entry, ref[n_prompt + j - 1], tid, 5, tok, sampled_rank=1)
        assert tid == int(ref[n_prompt + j - 1].argmax())
    total = sum(entry[tid].logprob for tid, entry in zip(comp.token_ids, comp.logprobs))
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-5)
    ref_total = sum(float(ref[n_prompt + j - 1, t]) for j, t in enumerate(comp.token_ids))
    assert comp.cumulative_logprob == pytest.approx(ref_total, abs=1e-3)

    # Prompt tokens (image placeholder positions included): the first has no logprob.
    plp = out.prompt_logprobs
    assert len(plp) == n_prompt and plp[0] is None
    for pos in range(1, n_prompt):
        check_position(plp[pos], ref[pos - 1], out.prompt_token_ids[pos], 3, tok)


def test_prompt_logprobs_with_chunked_prefill(tiny_ckpt):
    """A prompt prefilled in chunks of 8 tokens reports every position once, correctly."""
    from mmkit import LLM

    llm = LLM(str(tiny_ckpt), dtype="float32", max_num_batched_tokens=8)
    prompt = "Tell me a long story about the sea and the wind and the gulls"
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=0)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    model, _ = _hf_model(str(tiny_ckpt))
    full = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([full])).logits[0].log_softmax(-1)
    plp = out.prompt_logprobs
    assert len(out.prompt_token_ids) > 16
    assert len(plp) == len(out.prompt_token_ids) and plp[0] is None
    for pos in range(1, len(plp)):
        check_position(plp[pos], ref[pos - 1], out.prompt_token_ids[pos], 2, llm.get_tokenizer())
    # logprobs=0: only the sampled token, with its rank.
    for entry, tid in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
        assert list(entry) == [tid] and entry[tid].rank == 1


def test_sampled_logprobs_are_raw_and_ranked(tiny_ckpt):
    """Random sampling: the sampled token is always in the dict with its true rank and raw logprob."""
    llm = get_llm(tiny_ckpt)
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=10, logprobs=2, ignore_eos=True)
    out = llm.generate("Write a haiku about the sea.", params, use_tqdm=False)[0]
    comp = out.outputs[0]
    model, _ = _hf_model(str(tiny_ckpt))
    full = out.prompt_token_ids + comp.token_ids
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([full])).logits[0].log_softmax(-1)
    n = len(out.prompt_token_ids)
    ranks = []
    for j, (tid, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        check_position(entry, ref[n + j - 1], tid, 2, llm.get_tokenizer())
        ranks.append(entry[tid].rank)
    assert max(ranks) > 2  # temperature 1.5 on a random model: some draws are not top-2
    assert math.isclose(comp.cumulative_logprob, sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)),
                        abs_tol=1e-5)


def test_no_logprobs_requested(tiny_ckpt):
    out = get_llm(tiny_ckpt).generate("hi", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None


def test_logprobs_larger_than_vocab_is_clamped(tiny_ckpt):
    llm = get_llm(tiny_ckpt)
    vocab = len(llm.get_tokenizer())
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=2, logprobs=vocab + 10,
                                            prompt_logprobs=vocab + 10), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == vocab
    assert len(out.prompt_logprobs[1]) == vocab


@pytest.mark.parametrize("start", [-5, 21])
def test_prompt_logprobs_start_skips_early_positions_and_reuses_the_prefix(tiny_ckpt, start):
    """Positions before prompt_logprobs_start are None; the others equal a full run's, also
    when a shared prefix comes from the prefix cache (block_size 4: whole blocks are hits)."""
    from mmkit import LLM

    llm = LLM(str(tiny_ckpt), dtype="float32", block_size=4)
    prompt = "Tell me a long story about the sea and the wind and the gulls"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    n = len(full.prompt_token_ids)
    first = n + start if start < 0 else start
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=start)
    hits = llm.get_metrics()["prefix_cache_hits"]
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert llm.get_metrics()["prefix_cache_hits"] - hits == (first - 1) // 4 * 4 > 0
    assert len(out.prompt_logprobs) == n and all(p is None for p in out.prompt_logprobs[:first])
    for pos in range(first, n):
        tok = out.prompt_token_ids[pos]
        assert out.prompt_logprobs[pos][tok].logprob == pytest.approx(full.prompt_logprobs[pos][tok].logprob, abs=1e-5)
    with pytest.raises(TypeError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs_start=1.5)
