"""Idefics3 under a KV cache that holds only the largest request plus one block: its requests run
one after another with no preemption, because of the admission rule every family shares
(docs/architecture.md, "Admission under a small KV cache"), not because of its spans. A waiting
request is admitted only when its first chunk (the prompt, at most the step's token budget)
fits in the free blocks; 60-token prompts are 4 blocks of 16, and two of them never fit in 7.
A smaller first chunk (token budget 16) or an eighth block lets two share the cache, and the
one that outgrows it is preempted. Greedy ids equal transformers' in every case."""

from __future__ import annotations

import math

import pytest

from conftest import make_image
from span_ref import hf_span_greedy
from mmkit import LLM, SamplingParams
from mmkit.testing import build_tiny_checkpoint

N = 33
BLOCK = 16
P1 = "User:<image>What is in the image?<end_of_utterance>\nAssistant:"
IMAGES = [make_image(20 + i, 90, 50) for i in range(5)]  # each a 2x1 tile grid + global view: 60 tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = build_tiny_checkpoint("Idefics3ForConditionalGeneration", tmp_path_factory.mktemp("idefics3"), seed=4)
    return path, [hf_span_greedy(path, P1, [image], max_new_tokens=N) for image in IMAGES]


def run(path, **kwargs):
    """(token ids per request, preemptions, most sequences in one step)."""
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, **kwargs)
    runner = llm.llm_engine.model_runner
    execute, batch_sizes = runner.execute_model, []

    def counting(sched):
        batch_sizes.append(len(sched.num_scheduled_tokens))
        return execute(sched)

    runner.execute_model = counting
    inputs = [{"prompt": P1, "multi_modal_data": {"image": image}} for image in IMAGES]
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    assert {len(o.prompt_token_ids) for o in outs} == {60}
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()["num_preemptions"], max(batch_sizes)


LARGEST_PLUS_ONE = math.ceil((60 + N) / BLOCK) + 1  # 7 blocks; a prompt takes 4


@pytest.mark.parametrize("kwargs, concurrent", [
    (dict(num_kv_blocks=LARGEST_PLUS_ONE), False),  # 4 + 4 > 7: one at a time, never preempted
    (dict(num_kv_blocks=LARGEST_PLUS_ONE, max_num_batched_tokens=BLOCK), True),  # first chunk: 1 block
    (dict(num_kv_blocks=2 * 4), True),  # two prompts fit; the one that grows out of room is preempted
])
def test_tiny_kv_cache_admission(ckpt, kwargs, concurrent):
    path, refs = ckpt
    ids, num_preemptions, max_batch = run(path, **kwargs)
    assert ids == refs
    if concurrent:
        assert max_batch >= 2 and num_preemptions > 0, (max_batch, num_preemptions)
    else:
        assert (max_batch, num_preemptions) == (1, 0)
