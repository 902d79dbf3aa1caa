"""`LLM.beam_search` (vLLM's offline beam search) on the tiny random LLaVA checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICES, _hf_model, get_llm, make_image

from mmkit import LLM, BeamSearchParams, MultiModalData

PROMPT = "USER: <image>\nDescribe the image. ASSISTANT:"
MAX_TOKENS = 8


def hf_beam_search(path, prompt: str, image, num_beams: int, max_new_tokens: int):
    """transformers' own beam search: (sequences best first, their scores), new tokens only."""
    from transformers import GenerationConfig

    model, processor = _hf_model(str(path))
    inputs = processor(text=prompt, images=image, return_tensors="pt")
    config = GenerationConfig(num_beams=num_beams, num_return_sequences=num_beams, do_sample=False,
                              max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                              length_penalty=0.0, early_stopping=True)
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=config, output_scores=True, return_dict_in_generate=True)
    new = out.sequences[:, inputs["input_ids"].shape[1]:].tolist()
    scores = out.sequences_scores.tolist() if num_beams > 1 else None
    return new, scores


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beam_width", [1, 3, 4])
def test_best_beam_equals_transformers_beam_search(tiny_ckpt, beam_width, device):
    """Why the two searches coincide here: with EOS out of play (mmkit `ignore_eos=True`,
    transformers with `eos_token_id=None`, so EOS is an ordinary token on both sides and its
    logit is not masked as `min_new_tokens` would), no beam ever ends early, so both keep exactly
    `max_new_tokens` tokens on every beam. Each step transformers keeps the top `W` of all
    beam x vocab continuations by cumulative log-prob; mmkit keeps the top `W` of the union of
    each beam's top `2W`, and every member of the global top `W` is in its own beam's top `W`,
    so the sets are equal. With equal lengths the final ranking ignores the length penalty
    (`length_penalty=0.0` makes transformers' scores the plain cumulative log-probs, and
    `early_stopping` has no finished hypotheses to act on). W = 1 is greedy decoding on both."""
    image = make_image(0)
    llm = get_llm(tiny_ckpt, device)
    out = llm.beam_search({"prompt": PROMPT, "multi_modal_data": {"image": image}},
                          BeamSearchParams(beam_width=beam_width, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert len(out) == 1
    seqs = out[0].sequences
    assert len(seqs) == beam_width
    expected, scores = hf_beam_search(tiny_ckpt, PROMPT, image, beam_width, MAX_TOKENS)
    assert seqs[0].output_token_ids == expected[0]
    # Every beam, in order, with transformers' score (its cumulative log-prob here).
    assert [s.output_token_ids for s in seqs] == expected
    if scores is not None:
        assert [s.cum_logprob for s in seqs] == pytest.approx(scores, abs=1e-3)
    best = seqs[0]
    num_prompt = len(best.tokens) - MAX_TOKENS
    assert best.tokens[num_prompt:] == expected[0]  # tokens: prompt + generated, as vLLM's
    assert best.text == llm.get_tokenizer().decode(expected[0], skip_special_tokens=True)
    assert sum(best.logprobs[i][t].logprob for i, t in enumerate(expected[0])) == pytest.approx(best.cum_logprob)
    assert all(s.finish_reason == "length" for s in seqs)


def test_a_batch_in_every_input_form(tiny_ckpt):
    llm = get_llm(tiny_ckpt)
    tok_ids = llm.get_tokenizer()("USER: hello there. ASSISTANT:")["input_ids"]
    prompts = [
        "Write about the sea.",
        {"prompt_token_ids": tok_ids},
        {"prompt": PROMPT, "multi_modal_data": MultiModalData(type=MultiModalData.Type.IMAGE, data=make_image(1))},
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(2)}},
    ]
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    batch = llm.beam_search(prompts, params)
    assert len(batch) == len(prompts)
    for i, prompt in enumerate(prompts):
        alone = llm.beam_search(prompt, params)[0]
        assert [s.tokens for s in batch[i].sequences] == [s.tokens for s in alone.sequences], f"prompts[{i}]"
        assert [s.cum_logprob for s in batch[i].sequences] == pytest.approx([s.cum_logprob for s in alone.sequences])
        scores = [s.cum_logprob for s in batch[i].sequences]
        assert scores == sorted(scores, reverse=True)
    assert batch[1].sequences[0].tokens[:len(tok_ids)] == tok_ids


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_image_is_encoded_once_per_prompt(tiny_ckpt, prefix_caching):
    """Four beams for eight steps read each image's embeddings from one encoding: with prefix
    caching the later steps start after the cached image blocks; without it, every step's
    prefill takes the embeddings from the encoder cache."""
    llm = LLM(str(tiny_ckpt), dtype="float32", enable_prefix_caching=prefix_caching)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(10 + i)}} for i in range(2)]
    before = llm.get_metrics()
    llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True))
    after = llm.get_metrics()
    delta = {k: after[k] - before[k] for k in ("encoder_cache_misses", "encoder_cache_hits", "prefix_cache_hits")}
    assert delta["encoder_cache_misses"] == len(prompts), delta
    if prefix_caching:
        assert delta["prefix_cache_hits"] > 0, delta
    else:
        # every later step re-reads both images: one hit per beam request and step at least
        assert delta["encoder_cache_hits"] >= len(prompts) * (MAX_TOKENS - 1), delta
    assert after["kv_blocks_free"] == after["kv_blocks_total"]  # nothing left behind


def test_eos_ends_a_beam_and_is_kept(tiny_ckpt, monkeypatch):
    """A candidate that is EOS ends its beam ("stop"), stays among the results, and its text
    leaves the EOS out. Here EOS is made a token the search meets (the random model never picks
    the real one)."""
    llm = get_llm(tiny_ckpt)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": make_image(0)}}
    free = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    eos = free.sequences[0].output_token_ids[1]
    monkeypatch.setattr(llm.llm_engine, "eos_token_ids", (eos,))
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS))[0]
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped, [s.output_token_ids for s in out.sequences]
    for s in stopped:
        assert s.tokens[-1] == eos and eos not in s.output_token_ids[:-1]
        assert s.text == llm.get_tokenizer().decode(s.output_token_ids[:-1], skip_special_tokens=True)
    for s in out.sequences:
        if s.finish_reason == "length":
            assert len(s.output_token_ids) == MAX_TOKENS and eos not in s.output_token_ids
    # ignore_eos: the same token is ordinary
    assert all(s.finish_reason == "length" for s in
               llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True))[0].sequences)


@pytest.mark.parametrize("kwargs, field", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2.0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "ignore_eos": 1}, "ignore_eos"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": -0.5}, "temperature"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
])
def test_params_are_checked_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: got"):
        BeamSearchParams(**kwargs)


def test_bad_inputs_fail_before_anything_is_added(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=4)  # 64 tokens of KV cache
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    before = llm.get_metrics()
    with pytest.raises(ValueError, match=r"inputs\[1\]"):  # two images, one placeholder
        llm.beam_search(["Hi.", {"prompt": PROMPT, "multi_modal_data": {"image": [make_image(0), make_image(1)]}}],
                        params)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search("Hi.", {"beam_width": 2, "max_tokens": 4})
    with pytest.raises(ValueError, match="KV cache"):  # a beam would outgrow the cache
        llm.beam_search(["Hi.", "Hello."], BeamSearchParams(beam_width=2, max_tokens=70))
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.get_metrics()["prompt_tokens"] == before["prompt_tokens"]
    assert len(llm.beam_search("Hi.", params)[0].sequences) == 2  # the engine still works


def test_cli_caption_beam_width(tiny_ckpt, tmp_path):
    path = tmp_path / "img.png"
    make_image(3).save(path)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    args = [sys.executable, "-m", "mmkit", "caption", str(path), "--model", str(tiny_ckpt), "--max-tokens", "5"]
    out = subprocess.run(args + ["--beam-width", "3"], check=False, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    from mmkit.entrypoints.cli.main import CAPTION_QUESTION, question_inputs

    llm = get_llm(tiny_ckpt)
    best = llm.beam_search(question_inputs(llm, make_image(3), CAPTION_QUESTION),
                           BeamSearchParams(beam_width=3, max_tokens=5))[0].sequences[0]
    assert out.stdout.strip("\n") == best.text.strip()
    bad = subprocess.run(args + ["--beam-width", "0"], check=False, capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "beam_width: got 0" in bad.stderr and "loading" not in bad.stderr
