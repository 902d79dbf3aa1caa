"""GpuSampler (mmkit/layers/gpu_sampler.py) against the CPU Sampler on CPU: identical greedy ids,
penalties, min_tokens masks and logprobs; the same filtered distribution for random rows (top-k,
top-p, min-p), draws that follow it, seeded draws independent of the batch, and exactly one
host sync per call."""

from __future__ import annotations

import pytest
import torch

from mmkit import SamplingParams
from mmkit.layers.gpu_sampler import GpuSampler, hashed_exponential
from mmkit.layers.sampler import Sampler, SamplingRow

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def _rows(params_list, outputs=None, prompts=None):
    outputs = outputs or [[] for _ in params_list]
    prompts = prompts or [[] for _ in params_list]
    return [SamplingRow(p, torch.Generator().manual_seed(7 + i), pr, out, position=10 + i)
            for i, (p, pr, out) in enumerate(zip(params_list, prompts, outputs))]


def test_greedy_penalties_min_tokens_and_logprobs_equal_the_cpu_sampler():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0, repetition_penalty=1.7, logprobs=0),
              SamplingParams(temperature=0, frequency_penalty=0.8, presence_penalty=0.5, logprobs=2),
              SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[5], logprobs=1)]
    logits = _logits(len(params))
    logits[4, 5] = 50.0  # the stop token would win without the min_tokens mask
    outputs = [[], [], [3, 3, 9], [1, 1, 1, 2], [8]]
    prompts = [[], [], [4, 9], [], []]
    ref = Sampler()(logits.clone(), _rows(params, outputs, prompts))
    got = GpuSampler()(logits.clone(), _rows(params, outputs, prompts))
    assert got.token_ids == ref.token_ids and got.token_ids[4] != 5
    assert got.ranks == ref.ranks and got.top_ids == ref.top_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs))
    torch.testing.assert_close(torch.tensor(got.top_logprobs), torch.tensor(ref.top_logprobs))


def test_min_tokens_keeps_the_only_allowed_token():
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 5] = 1.0  # a grammar that allows the stop token alone
    rows = _rows([SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])])
    assert GpuSampler()(logits, rows).token_ids == Sampler()(logits.clone(), rows).token_ids == [5]


@pytest.mark.parametrize("spec", [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=8, top_p=0.9, min_p=0.05)])
def test_random_draws_follow_the_cpu_samplers_filtered_distribution(spec):
    """The CPU sampler's filtered distribution (top-k/top-p/min-p, temperature 0.7): every GpuSampler
    draw is inside its support, and 4000 draws (positions 0..3999) match its probabilities."""
    params = SamplingParams(temperature=0.7, **spec)
    row_logits = _logits(1, seed=3)[0]
    from mmkit.layers.sampler import filter_logits

    vocab = VOCAB
    filtered = filter_logits(row_logits[None] / 0.7, torch.tensor([spec.get("top_k", vocab)]),
                             torch.tensor([spec.get("top_p", 1.0)]), torch.tensor([spec.get("min_p", 0.0)]))
    probs = filtered.softmax(-1)[0]
    n = 4000
    rows = [SamplingRow(params, torch.Generator().manual_seed(1), [], [], position=i) for i in range(n)]
    draws = torch.tensor(GpuSampler()(row_logits.expand(n, -1).clone(), rows).token_ids)
    assert bool((probs[draws] > 0).all())
    freq = torch.bincount(draws, minlength=vocab).float() / n
    assert (freq - probs).abs().max() < 0.035  # ~4.5 sigma for the likeliest token


def test_seeded_draws_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0)
    target = _logits(1, seed=5)
    others = _logits(6, seed=6)
    alone = GpuSampler()(target.clone(), [SamplingRow(params, torch.Generator().manual_seed(42), [], [], 17)])
    for where in (0, 3, 6):
        logits = torch.cat([others[:where], target, others[where:]])
        rows = [SamplingRow(params, torch.Generator().manual_seed(100 + i), [], [], 17) for i in range(6)]
        rows.insert(where, SamplingRow(params, torch.Generator().manual_seed(42), [], [], 17))
        assert GpuSampler()(logits, rows).token_ids[where] == alone.token_ids[0]
    # Another position or seed: another draw stream.
    noise = hashed_exponential(torch.tensor([42, 42, 43]), torch.tensor([17, 18, 17]), VOCAB)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert abs(noise.mean().item() - 1.0) < 0.1 and bool((noise > 0).all())


def test_one_host_sync_per_call(monkeypatch):
    """Every readback goes through one `.tolist()` of one tensor (no `.item()`, `int(t)` or per-row lists)."""
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(self.shape) or real(self))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("item() in the sampler"))
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1),
              SamplingParams(temperature=1.0, top_k=3, min_tokens=2, stop_token_ids=[1], repetition_penalty=1.2)]
    out = GpuSampler()(_logits(3), _rows(params, [[], [], [2]], [[4], [], [5]]))
    assert len(calls) == 1 and len(out.token_ids) == 3
    assert out.top_ids is not None and len(out.top_ids[0]) == 2


@pytest.mark.cuda
def test_cuda_equals_cpu():
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.8, top_p=0.9, seed=3)]
    logits = _logits(2)
    cpu = GpuSampler()(logits.clone(), _rows(params))
    gpu = GpuSampler()(logits.cuda(), _rows(params))
    assert gpu.token_ids == cpu.token_ids
    torch.testing.assert_close(torch.tensor(gpu.logprobs), torch.tensor(cpu.logprobs))
