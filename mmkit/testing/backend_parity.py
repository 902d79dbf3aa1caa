"""`assert_backend_parity`: one checkpoint on mmkit's engine against transformers' own greedy ids.

A reusable check for any architecture run through the transformers backend (or natively): the
cases go through `LLM.generate` under several engine settings, each output compared with
transformers' `generate` on the same prompt (float32, greedy, EOS never stops either side):

- "batch": every case in one `generate` call (text only, one image, two images of different
  sizes, a token-id prompt: whatever the caller passes);
- "chunked": a token budget smaller than the image spans, so chunked prefill splits them;
- "preempt": a KV cache barely larger than the longest request, so requests are preempted
  (checked: `num_preemptions > 0`) and recomputed;
- "prefix": the same batch again on the same engine, its prompts' blocks read from the prefix
  cache (checked: `prefix_cache_hits > 0`).

    from mmkit.testing.backend_parity import ParityCase, assert_backend_parity
    assert_backend_parity(path, [ParityCase("USER: <image>\\nDescribe. ASSISTANT:", [img]),
                                 ParityCase("Hello")], model_impl="transformers")

`reference` replaces transformers' run for a family whose reference needs a local workaround:
a callable `(case, max_new_tokens) -> list[int]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


@dataclass
class ParityCase:
    """One prompt: `prompt` is text, or token ids (given to mmkit as `prompt_token_ids`; the
    reference runs `text`, the same prompt as text, which must then be set)."""

    prompt: str | list[int]
    images: list[Any] = field(default_factory=list)
    text: str | None = None  # the text of a token-id prompt, for the reference
    name: str = ""

    def reference_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.text

    def as_input(self) -> Any:
        key = "prompt" if isinstance(self.prompt, str) else "prompt_token_ids"
        inp: dict[str, Any] = {key: self.prompt}
        if self.images:
            inp["multi_modal_data"] = {"image": list(self.images)}
        return inp


class TransformersReference:
    """transformers' own model and processor for a checkpoint; greedy ids with EOS ignored."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        import transformers
        from transformers import AutoConfig, AutoProcessor

        config = AutoConfig.from_pretrained(path)
        cls = getattr(transformers, config.architectures[0])
        self.model = cls.from_pretrained(path, dtype=dtype).eval()
        # EOS never stops the reference (mmkit runs with ignore_eos=True).
        self.model.generation_config.eos_token_id = None
        self.processor = AutoProcessor.from_pretrained(path)

    def inputs(self, case: ParityCase) -> Any:
        kwargs = {"images": list(case.images)} if case.images else {}
        return self.processor(text=[case.reference_text()], return_tensors="pt", **kwargs)

    def greedy(self, case: ParityCase, max_new_tokens: int) -> list[int]:
        inputs = self.inputs(case)
        pad = getattr(self.processor, "tokenizer", self.processor).pad_token_id or 0
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=pad)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


def assert_backend_parity(path: Any, cases: Sequence[ParityCase], *, model_impl: str = "transformers",
                          max_tokens: int = 8, checks: Sequence[str] = ("batch", "chunked", "preempt", "prefix"),
                          reference: Callable[[ParityCase, int], list[int]] | None = None,
                          block_size: int = 4, **engine_kwargs: Any) -> dict[str, list[list[int]]]:
    """Run the checks (see the module docstring); an AssertionError names the check, the case
    and both id lists. Returns {check: ids per case}."""
    from mmkit import LLM, SamplingParams

    path = str(path)
    if reference is None:
        ref_model = TransformersReference(path)
        reference = ref_model.greedy
    # Preemption needs decodes that outgrow the cache: that check generates 4x longer (and twice
    # each case); one reference run of that length gives every check's expected ids.
    long_tokens = 4 * max_tokens if "preempt" in checks else max_tokens
    expected_long = [reference(case, long_tokens) for case in cases]
    expected = [ids[:max_tokens] for ids in expected_long]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    inputs = [case.as_input() for case in cases]
    base = dict(dtype="float32", device="cpu", model_impl=model_impl, block_size=block_size, **engine_kwargs)
    results: dict[str, list[list[int]]] = {}

    def run(check: str, llm: Any, repeat: int = 1, run_params: Any = params, want_ids=expected) -> list[Any]:
        outs = llm.generate(inputs * repeat, run_params, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        for case, ids, want in zip(list(cases) * repeat, got, want_ids * repeat):
            assert ids == want, (f"{check}: case {case.name or case.prompt!r}: mmkit ({model_impl}) {ids} != "
                                 f"transformers {want}")
        results[check] = got
        return outs

    llm = LLM(model=path, **base)
    if "batch" in checks or "prefix" in checks:
        outs = run("batch", llm)
        if "prefix" in checks:
            before = llm.get_metrics()["prefix_cache_hits"]
            run("prefix", llm)
            hits = llm.get_metrics()["prefix_cache_hits"] - before
            assert hits > 0, "prefix: the second run of the same batch read no block from the prefix cache"
    else:
        outs = None
    lengths = [len(o.prompt_token_ids) for o in outs] if outs else None
    del llm
    if "chunked" in checks:
        # A budget below the shortest image span (at least 2 tokens): every span is split.
        budget = max(2, min(_span_lengths(path, base, inputs) or [8]) // 2)
        llm = LLM(model=path, max_num_batched_tokens=budget, **base)
        run("chunked", llm)
        del llm
    if "preempt" in checks:
        if lengths is None:
            probe = LLM(model=path, **base)
            lengths = [len(o.prompt_token_ids) for o in probe.generate(inputs, params, use_tqdm=False)]
            del probe
        longest = max(lengths) + long_tokens
        blocks = math.ceil(longest / block_size) + 1
        llm = LLM(model=path, num_kv_blocks=blocks, **base)
        long_params = SamplingParams(temperature=0, max_tokens=long_tokens, ignore_eos=True)
        run("preempt", llm, repeat=2, run_params=long_params, want_ids=expected_long)
        if len(cases) > 1:
            assert llm.get_metrics()["num_preemptions"] > 0, \
                f"preempt: {blocks} KV blocks of {block_size} forced no preemption"
        del llm
    return results


def _span_lengths(path: str, base: dict, inputs: list[Any]) -> list[int]:
    """The placeholder span lengths of the inputs, as the engine's processor expands them."""
    from mmkit.config import EngineArgs
    from mmkit.multimodal.parse import parse_inputs
    from mmkit.processors import get_input_processor

    config = EngineArgs(model=path, **base).create_engine_config()
    processor = get_input_processor(config.model, config.tokenizer_path, config.limit_mm_per_prompt,
                                    config.mm_processor_kwargs)
    lengths = []
    for parsed in parse_inputs(inputs):
        lengths.extend(r.length for r in processor.process(parsed).placeholder_ranges)
    return lengths
