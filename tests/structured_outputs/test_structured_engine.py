"""Structured outputs through the engine on tiny random checkpoints (whose free output is noise)."""

import asyncio
import json
import re

import jsonschema
import pytest

from conftest import get_llm, make_image
from mmkit import LLM, AsyncLLMEngine, EngineArgs, SamplingParams, StructuredOutputsParams

PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
REGEX = "[0-9]{3}-[a-z]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 12},
        "visible": {"type": "boolean"},
        # NOTE: a pattern, not maxLength: xgrammar's maxLength strings admit control characters.
        "box": {"type": "object", "properties": {"label": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
                                                 "x": {"type": "integer", "minimum": -5, "maximum": 99}},
                "required": ["label", "x"]},
    },
    "required": ["color", "count", "visible", "box"],
}
CHOICES = [["yes", "no"], ["red", "green", "blue", "purple"], ["one", "two", "three", "four", "five"],
           ["circle", "square", "triangle"], ["A", "B", "C", "D"], ['say "hi"', "new\nline", "é"]]


def prompts(n, with_images=True):
    return [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(i)}} if with_images and i % 4 == 0
            else f"Question number {i}: pick one." for i in range(n)]


def so(**kwargs):
    return StructuredOutputsParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return get_llm(tiny_ckpt)


def test_64_choice_requests(llm):
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=12,
                             structured_outputs=so(choice=CHOICES[i % len(CHOICES)])) for i in range(64)]
    outs = llm.generate(prompts(64), params, use_tqdm=False)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.text in CHOICES[i % len(CHOICES)] and c.finish_reason == "stop", (i, c.text, c.finish_reason)


def test_regex_greedy_and_seeded_one_compile(llm):
    backend = llm.llm_engine.structured_backend
    before = backend.num_compiles
    spec = so(regex=REGEX)
    greedy = SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=7, max_tokens=20, structured_outputs=spec)
    outs = llm.generate(prompts(16), [greedy, seeded] * 8, use_tqdm=False)
    for out in outs:
        assert re.fullmatch(REGEX, out.outputs[0].text) and out.outputs[0].finish_reason == "stop", out.outputs[0]
    assert backend.num_compiles == before + 1  # same spec, one compile for all 16 requests
    again = llm.generate(prompts(16), [greedy, seeded] * 8, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]  # seeds hold


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_json_schema_validates(llm, mode):
    sampling = {"temperature": 0} if mode == "greedy" else {"temperature": 1.0, "seed": 3}
    params = SamplingParams(max_tokens=150, structured_outputs=so(json=SCHEMA), **sampling)
    outs = llm.generate(prompts(8), params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.text == json.dumps(json.loads(c.text), ensure_ascii=False)  # compact: no free whitespace by default


def test_n3_forks_the_grammar(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=150, structured_outputs=so(json=SCHEMA))
    choice = SamplingParams(n=3, temperature=1.5, seed=5, max_tokens=24,
                            structured_outputs=so(choice=["alpha", "beta", "gamma delta"]))
    outs = llm.generate(prompts(4), [params, choice, params, choice], use_tqdm=False)
    for i, out in enumerate(outs):
        assert len(out.outputs) == 3
        for c in out.outputs:
            assert c.finish_reason == "stop"
            if i % 2 == 0:
                jsonschema.validate(json.loads(c.text), SCHEMA)
            else:
                assert c.text in ("alpha", "beta", "gamma delta")
    assert len({c.text for out in outs[::2] for c in out.outputs}) > 1  # the samples differ


def test_mixed_batch_leaves_unconstrained_identical(llm):
    inputs = prompts(12)
    free = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=4, max_tokens=16, logprobs=2)]
    ref = llm.generate(inputs, [free[i % 2] for i in range(12)], use_tqdm=False)
    mixed_params = [free[i % 2] if i % 3 else SamplingParams(temperature=0.7, seed=i, max_tokens=40,
                                                             structured_outputs=so(json=SCHEMA))
                    for i in range(12)]
    mixed = llm.generate(inputs, mixed_params, use_tqdm=False)
    for i in range(12):
        if i % 3:
            assert mixed[i].outputs[0].token_ids == ref[i].outputs[0].token_ids
            if i % 2:
                _assert_same_logprobs(mixed[i].outputs[0].logprobs, ref[i].outputs[0].logprobs)


def _assert_same_logprobs(got, want, tol=1e-5):
    """Same tokens, ranks and text at every position; values within `tol`. NOTE: the two
    batches differ in composition (the constrained rows run longer), so the GEMMs see other row
    counts and float32 sums may differ in the last ulps (seen: 1e-6), not in any token."""
    assert len(got) == len(want)
    for pos, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), pos
        for tok in g:
            assert (g[tok].rank, g[tok].decoded_token) == (w[tok].rank, w[tok].decoded_token), (pos, tok)
            assert abs(g[tok].logprob - w[tok].logprob) <= tol, (pos, tok, g[tok].logprob, w[tok].logprob)


def test_satisfied_constraint_changes_nothing(llm):
    """Greedy output constrained to (a choice of) its own text: the mask removes nothing."""
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tok = llm.get_tokenizer()
    checked = 0
    for out in llm.generate(prompts(8, with_images=False), free, use_tqdm=False):
        ids = out.outputs[0].token_ids
        # The longest prefix that is a character string (random models emit stray bytes).
        k = max((k for k in range(len(ids) + 1) if "\ufffd" not in tok.decode(ids[:k])
                 and not set(ids[:k]) & set(tok.all_special_ids)), default=0)
        if k < 3:
            continue
        text = tok.decode(ids[:k])
        constrained = SamplingParams(temperature=0, max_tokens=k,
                                     structured_outputs=so(choice=[text, "nothing like it"]))
        again = llm.generate(out.prompt, constrained, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == ids[:k] and again.outputs[0].finish_reason == "length"
        checked += 1
    assert checked >= 2


def test_preemption_changes_no_output(tiny_ckpt, llm):
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=60,
                             structured_outputs=so(json=SCHEMA)) for i in range(6)]
    inputs = prompts(6, with_images=False)
    ref = llm.generate(inputs, params, use_tqdm=False)
    small = LLM(str(tiny_ckpt), dtype="float32", num_kv_blocks=12, block_size=8)
    outs = small.generate(inputs, params, use_tqdm=False)
    assert small.get_metrics()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_max_tokens_ends_with_length(llm):
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, structured_outputs=so(json=SCHEMA)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and '{"color": "'.startswith(out.text)


def test_logprobs_are_of_the_constrained_distribution(llm):
    import math

    tok = llm.get_tokenizer()
    choices = ["a", "b"]
    assert all(len(tok.encode(c, add_special_tokens=False)) == 1 for c in choices)
    allowed = {tok.convert_tokens_to_ids(c) for c in choices}
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=5, structured_outputs=so(choice=choices))
    c = llm.generate("pick a letter", params, use_tqdm=False)[0].outputs[0]
    assert c.text in choices and len(c.logprobs) == 2  # the letter, then EOS
    first = {t: lp.logprob for t, lp in c.logprobs[0].items() if lp.logprob > -math.inf}
    assert set(first) == allowed
    assert sum(math.exp(v) for v in first.values()) == pytest.approx(1.0, abs=1e-5)
    assert c.logprobs[1][tok.eos_token_id].logprob == pytest.approx(0.0, abs=1e-6)
    assert c.cumulative_logprob == pytest.approx(max(first.values()), abs=1e-5)


def test_stop_strings_cut_constrained_output(llm):
    params = SamplingParams(temperature=0, max_tokens=20, stop=["-"], structured_outputs=so(regex=REGEX))
    for out in llm.generate(prompts(4, with_images=False), params, use_tqdm=False):
        c = out.outputs[0]
        assert re.fullmatch("[0-9]{3}", c.text) and c.finish_reason == "stop" and c.stop_reason == "-"


def test_bad_spec_rejected_before_any_request(llm):
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(structured_outputs=so(regex="(x"))])
    assert not llm.llm_engine.has_unfinished_requests()


def test_streaming_async_engine(tiny_ckpt, llm):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_ckpt), dtype="float32", seed=0))
    params = SamplingParams(temperature=0, max_tokens=150, structured_outputs=so(json=SCHEMA))
    inputs = prompts(2)

    async def main():
        async def one(i):
            return [o async for o in engine.generate(inputs[i], params, f"s{i}")]
        return await asyncio.gather(one(0), one(1))

    try:
        streams = asyncio.run(main())
    finally:
        engine.shutdown()
    ref = llm.generate(inputs, params, use_tqdm=False)
    for chunks, want in zip(streams, ref):
        texts = [c.outputs[0].text for c in chunks]
        assert len(chunks) > 3 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert chunks[-1].finished and chunks[-1].outputs[0].token_ids == want.outputs[0].token_ids
        jsonschema.validate(json.loads(texts[-1]), SCHEMA)


def test_ignore_eos_after_the_grammar_completes_allows_eos_alone(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.9, seed=1, max_tokens=12, ignore_eos=True,
                            structured_outputs=so(choice=["ab", "cd"]))
    c = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert c.text in ("ab", "cd") and c.finish_reason == "length" and len(c.token_ids) == 12
    answer_len = len(c.token_ids) - c.token_ids.index(tok.eos_token_id)
    assert c.token_ids[-answer_len:] == [tok.eos_token_id] * answer_len


def test_min_tokens_cannot_ban_the_only_allowed_token(llm):
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=10, min_tokens=6,
                            structured_outputs=so(choice=["ab", "cd"]))
    c = llm.generate("y", params, use_tqdm=False)[0].outputs[0]
    assert c.text in ("ab", "cd") and c.finish_reason == "stop"
