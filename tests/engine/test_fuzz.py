"""Fuzz: garbage for LLM.generate's inputs and SamplingParams raises only ValueError/TypeError.

Anything else (IndexError, RuntimeError from torch, a tokenizer's own exception, a hang) is a
bug: a user's bad item must be reported as a bad item. After every call the engine must hold
no request and no block.
"""

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from conftest import get_llm
from mmkit import MultiModalData, SamplingParams

PROMPT = "USER: <image>\nWhat is it? ASSISTANT:"
DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=5)))
    kind = draw(st.sampled_from(["zeros", "ones", "rand", "big", "nan", "neg"]))
    base = {"zeros": torch.zeros(shape), "ones": torch.ones(shape), "rand": torch.rand(shape),
            "big": torch.rand(shape) * 300, "nan": torch.full(shape, float("nan")),
            "neg": -torch.rand(shape)}[kind]
    if dtype.is_floating_point or dtype.is_complex:
        return base.to(dtype)
    return base.nan_to_num(0).clamp(-100, 255).to(dtype)


@st.composite
def pil_images(draw):
    mode = draw(st.sampled_from(["RGB", "L", "RGBA", "P", "1", "CMYK", "I", "F", "LA"]))
    width, height = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    return Image.new(mode, (width, height))


def multi_modal(children):
    data = st.one_of(pil_images(), tensors(), st.lists(st.one_of(pil_images(), tensors()), max_size=3), children)
    return st.one_of(
        st.builds(MultiModalData, type=st.sampled_from(list(MultiModalData.Type)), data=data),
        st.dictionaries(st.sampled_from(["image", "image_embeds", "video", "images"]), data, max_size=2),
    )


TEXT = st.one_of(st.sampled_from(["", "hello", PROMPT, "<image>", "<image><image> hi", "\ud800 lone", "a\x00b",
                                  "USER: <image>\n" * 3]),
                 st.text(max_size=20))
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                   TEXT, st.binary(max_size=16), tensors(), pil_images())


def garbage():
    return st.recursive(
        LEAVES,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.tuples(children, children),
            st.dictionaries(st.sampled_from(["prompt", "prompt_token_ids", "multi_modal_data", "extra", 1]),
                            children, max_size=3),
            multi_modal(children),
        ),
        max_leaves=12,
    )


def prompt_dicts():
    token_ids = st.one_of(st.lists(st.integers(-5, 500), max_size=8), tensors(), LEAVES)
    return st.one_of(
        st.fixed_dictionaries({"prompt": TEXT}, optional={"multi_modal_data": multi_modal(LEAVES)}),
        st.fixed_dictionaries({"prompt_token_ids": token_ids}, optional={"multi_modal_data": multi_modal(LEAVES)}),
    )


INPUTS = st.one_of(TEXT, prompt_dicts(), st.lists(st.one_of(TEXT, prompt_dicts(), garbage()), max_size=4),
                   garbage())

PARAM_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
                         st.lists(st.one_of(st.integers(-2, 400), st.text(max_size=3)), max_size=3))
PARAM_NAMES = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
               "min_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens", "bogus_knob"]


@st.composite
def sampling_params(draw):
    kwargs = draw(st.dictionaries(st.sampled_from(PARAM_NAMES), PARAM_VALUES, max_size=4))
    # Keep runs short: max_tokens is fuzzed, but never None (that would decode to max_model_len).
    kwargs["max_tokens"] = draw(st.one_of(st.integers(-1, 3), st.floats(0, 3), st.text(max_size=2)))
    if isinstance(kwargs.get("n"), int) and not isinstance(kwargs.get("n"), bool) and kwargs["n"] > 3:
        kwargs["n"] = 3
    for key in ("logprobs", "prompt_logprobs"):
        if isinstance(kwargs.get(key), int) and not isinstance(kwargs[key], bool) and kwargs[key] > 10**6:
            kwargs[key] = 10**6
    return kwargs


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return get_llm(tiny_ckpt)


def assert_engine_clean(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(inputs=INPUTS, params=sampling_params(), per_prompt=st.booleans())
def test_generate_garbage_raises_only_value_or_type_errors(llm, inputs, params, per_prompt):
    try:
        sp = SamplingParams(**params)
    except (ValueError, TypeError):
        sp = SamplingParams(max_tokens=2)
    sp_arg = [sp] * len(inputs) if per_prompt and isinstance(inputs, list) else sp
    try:
        outs = llm.generate(inputs, sp_arg, use_tqdm=False)
    except (ValueError, TypeError) as exc:
        assert str(exc), "an error without a message"
        event(f"rejected: {type(exc).__name__}")
    else:
        assert all(o.finished for o in outs)
        event("generated")
    assert_engine_clean(llm)


@settings(max_examples=150, deadline=None)
@given(params=sampling_params())
def test_sampling_params_garbage(params):
    try:
        SamplingParams(**params)
    except (ValueError, TypeError) as exc:
        assert str(exc)


def test_fuzz_found_cases(llm):
    """Cases the fuzzer found once, kept as plain regressions."""
    for bad in ["\ud800 lone surrogate", {"prompt": "x\udfff"}]:
        with pytest.raises(ValueError, match=r"inputs\[0\].*surrogate"):
            llm.generate(bad, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="no image"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(0, 3, 4, 4)}}, use_tqdm=False)
    assert_engine_clean(llm)
