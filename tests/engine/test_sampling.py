"""SamplingParams validation, the Sampler's filters against analytic distributions, penalties
against transformers' / vLLM's formulas, and batched sampling."""

import math
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import _hf_model, get_llm
from mmkit import SamplingParams
from mmkit.layers import sampler as sampler_mod
from mmkit.layers.sampler import Sampler, SamplingRow, apply_penalties, filter_logits

# ---------------------------------------------------------------------------------------------
# SamplingParams validation
# ---------------------------------------------------------------------------------------------

INVALID = [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "hot"), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", float("nan")), ("top_p", "1"),
    ("top_k", -2), ("top_k", 2.5), ("top_k", "5"), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.01), ("min_p", float("nan")), ("min_p", None),
    ("n", 0), ("n", -1), ("n", 1.0), ("n", "2"),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 3.0),
    ("min_tokens", -1), ("min_tokens", 1.5),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", float("inf")),
    ("frequency_penalty", 2.01), ("frequency_penalty", -3.0), ("frequency_penalty", "0"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("repetition_penalty", float("nan")),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", ""]), ("stop", 5), ("stop", [5]), ("stop", b"x"),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["3"]), ("stop_token_ids", [1.0]), ("stop_token_ids", 7),
    ("stop_token_ids", [True]),
    ("logprobs", -1), ("logprobs", 1.5), ("logprobs", True),
    ("prompt_logprobs", -1), ("prompt_logprobs", "3"),
    ("seed", 1.5), ("seed", "7"),
    ("ignore_eos", 1), ("include_stop_str_in_output", "yes"), ("skip_special_tokens", None),
    ("spaces_between_special_tokens", 0),
]


@pytest.mark.parametrize("name,value", INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_parameter_names_itself_and_value(name, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    msg = str(info.value)
    assert msg.startswith(name), msg
    if isinstance(value, list):  # the offending element is named, e.g. "stop[1]: got ''"
        i, bad = next((i, v) for i, v in enumerate(value) if v in ("", 5, -1, True, 1.0, "3"))
        assert msg.startswith(f"{name}[{i}]: got {bad!r}"), msg
    else:
        assert repr(value) in msg, msg
    assert "expected" in msg, msg


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens: got 9; expected min_tokens <= max_tokens \(4\)"):
        SamplingParams(min_tokens=9, max_tokens=4)


@pytest.mark.parametrize("kwargs", [
    {}, {"temperature": 0}, {"temperature": 0.0, "top_p": 1.0}, {"top_k": 0}, {"top_k": -1},
    {"top_k": 50, "top_p": 0.01, "min_p": 1.0}, {"presence_penalty": -2, "frequency_penalty": 2},
    {"repetition_penalty": 0.5}, {"stop": "x", "stop_token_ids": (2, 3)}, {"max_tokens": None},
    {"min_tokens": 4, "max_tokens": 4}, {"logprobs": 0, "prompt_logprobs": 0}, {"seed": -3},
    {"n": 4, "seed": 0},
])
def test_valid_parameters(kwargs):
    p = SamplingParams(**kwargs)
    assert isinstance(p.stop, list) and isinstance(p.stop_token_ids, list)
    assert p.top_k != 0  # 0 is normalized to -1 (off)


def test_stop_string_normalized():
    assert SamplingParams(stop="ab").stop == ["ab"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


# ---------------------------------------------------------------------------------------------
# Filters: empirical distribution vs the analytically filtered softmax
# ---------------------------------------------------------------------------------------------

LOGITS = np.array([2.0, 1.6, 1.3, 0.9, 0.55, 0.3, 0.0, -0.4, -0.8, -1.3, -2.0, -3.1])
NUM_DRAWS = 20_000


def reference_probs(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """vLLM's semantics, written independently: temperature -> top-k -> top-p -> min-p."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(len(p), dtype=bool)
    k = len(p) if top_k in (-1, 0) else top_k
    keep[order[:k]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    # top-p: the smallest set of most likely tokens whose mass reaches top_p.
    mass = 0.0
    for tok in order:
        if not keep[tok]:
            continue
        if mass >= top_p:
            keep[tok] = False
        mass += q[tok]
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    keep &= q >= min_p * q.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def chi_square_ok(counts, probs):
    """Pearson's chi-square on the tokens the filter keeps; p-value must exceed 1e-3."""
    kept = probs > 0
    obs = counts[kept]
    exp = probs[kept] * counts.sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = int(kept.sum()) - 1
    if dof == 0:
        return True, stat
    try:
        from scipy.stats import chi2

        return chi2.sf(stat, dof) > 1e-3, stat
    except ImportError:  # Wilson-Hilferty approximation of the 0.999 quantile
        z = 3.090
        crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
        return stat < crit, stat


def draw(params, num=NUM_DRAWS, seed=1234, logits=LOGITS):
    base = torch.tensor(logits, dtype=torch.float32)
    rows = [SamplingRow(params, torch.Generator().manual_seed(seed + i), [], []) for i in range(num)]
    out = Sampler()(base.expand(num, -1).clone(), rows)
    return np.bincount(np.array(out.token_ids), minlength=len(logits))


FILTER_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.0),
    dict(temperature=1.0, top_k=4),
    dict(temperature=0.8, top_p=0.6),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.5, top_k=8, top_p=0.8, min_p=0.1),
]


@pytest.mark.parametrize("case", FILTER_CASES, ids=[str(c) for c in FILTER_CASES])
def test_empirical_distribution_matches_filtered_softmax(case):
    expected = reference_probs(LOGITS, **case)
    counts = draw(SamplingParams(**case))
    assert counts.sum() == NUM_DRAWS
    outside = np.flatnonzero(expected == 0)
    assert counts[outside].sum() == 0, f"filtered-out tokens drawn: {dict(zip(outside, counts[outside]))}"
    ok, stat = chi_square_ok(counts, expected)
    assert ok, f"chi-square {stat:.1f}; counts {counts.tolist()} vs expected {(expected * NUM_DRAWS).round().tolist()}"


def test_reference_really_filters():
    # Guards the test itself: each case above keeps a strict subset, or changes the shape.
    assert (reference_probs(LOGITS, top_k=4) > 0).sum() == 4
    assert 1 < (reference_probs(LOGITS, top_p=0.6, temperature=0.8) > 0).sum() < 6
    assert 1 < (reference_probs(LOGITS, min_p=0.2) > 0).sum() < 8
    # A sampler that ignored temperature would fail the temperature=0.5 case.
    t1, t05 = reference_probs(LOGITS), reference_probs(LOGITS, temperature=0.5)
    ok, _ = chi_square_ok(np.round(t1 * NUM_DRAWS), t05)
    assert not ok


def test_filter_logits_mixed_rows_against_reference():
    """One call, rows with different filters: kept sets and renormalized probs are exact."""
    cases = [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.3), dict(top_k=6, top_p=0.7, min_p=0.2), dict()]
    vocab = len(LOGITS)
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(len(cases), -1).clone()
    # Shuffle each row differently so the filter cannot rely on the token order.
    perms = [torch.randperm(vocab, generator=torch.Generator().manual_seed(i)) for i in range(len(cases))]
    logits = torch.stack([logits[i, p] for i, p in enumerate(perms)])
    top_k = torch.tensor([c.get("top_k", vocab) for c in cases])
    top_p = torch.tensor([c.get("top_p", 1.0) for c in cases])
    min_p = torch.tensor([c.get("min_p", 0.0) for c in cases])
    probs = filter_logits(logits, top_k, top_p, min_p).softmax(-1).double().numpy()
    for i, case in enumerate(cases):
        expected = reference_probs(LOGITS, **case)[perms[i].numpy()]
        np.testing.assert_allclose(probs[i], expected, atol=1e-6)


def test_greedy_rows_and_top_k_1_are_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(temperature=0), None, [], []) for _ in range(3)]
    rows += [SamplingRow(SamplingParams(temperature=1.0, top_k=1), torch.Generator().manual_seed(i), [], [])
             for i in range(3)]
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_per_row_generators_are_independent_of_the_batch():
    params = SamplingParams(temperature=1.0)
    vocab = 64
    target_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    others = torch.randn(7, vocab, generator=torch.Generator().manual_seed(6))
    sampler = Sampler()

    def run(position, other_seed_base, steps=40):
        gen = torch.Generator().manual_seed(42)
        other_gens = [torch.Generator().manual_seed(other_seed_base + i) for i in range(7)]
        tokens = []
        for _ in range(steps):
            logits = torch.cat([others[:position], target_logits[None], others[position:]])
            rows = [SamplingRow(params, g, [], []) for g in other_gens]
            rows.insert(position, SamplingRow(params, gen, [], []))
            tokens.append(sampler(logits, rows).token_ids[position])
        return tokens

    alone = []
    gen = torch.Generator().manual_seed(42)
    for _ in range(40):
        alone.append(sampler(target_logits[None].clone(), [SamplingRow(params, gen, [], [])]).token_ids[0])
    assert run(0, 100) == alone
    assert run(5, 900) == alone
    assert run(7, 7) == alone
    # A different seed gives a different sequence.
    gen = torch.Generator().manual_seed(43)
    other = [sampler(target_logits[None].clone(), [SamplingRow(params, gen, [], [])]).token_ids[0]
             for _ in range(40)]
    assert other != alone


# ---------------------------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------------------------

def test_repetition_penalty_equals_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    vocab = 40
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g) * 3
    specs = [  # (penalty, prompt tokens, output tokens)
        (1.3, [1, 5, 5, 9], [9, 12, 12, 30]),
        (0.7, [2, 3], [3, 4, 4, 4]),
        (2.0, [], [0, 39]),
        (1.0, [7, 8], [7]),
    ]
    rows = [SamplingRow(SamplingParams(repetition_penalty=p), None, pr, out) for p, pr, out in specs]
    got = apply_penalties(logits.clone(), rows)
    for i, (penalty, prompt, output) in enumerate(specs):
        ids = torch.tensor([prompt + output], dtype=torch.long)
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i:i + 1].clone())[0]
        torch.testing.assert_close(got[i], ref, rtol=0, atol=1e-6)
        if penalty != 1.0:
            assert not torch.equal(got[i], logits[i])


def test_presence_and_frequency_follow_vllm():
    vocab = 30
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    specs = [  # (presence, frequency, repetition, prompt, output)
        (0.5, 0.25, 1.0, [1, 2, 3], [4, 4, 4, 7, 9, 9]),
        (-1.0, 1.5, 1.0, [4], [0, 0, 29]),
        (0.8, -0.4, 1.2, [5, 6], [6, 6, 11]),
    ]
    rows = [SamplingRow(SamplingParams(presence_penalty=pp, frequency_penalty=fp, repetition_penalty=rp),
                        None, pr, out) for pp, fp, rp, pr, out in specs]
    got = apply_penalties(logits.clone(), rows)
    for i, (pp, fp, rp, prompt, output) in enumerate(specs):
        ref = logits[i].double().clone()
        for tok in set(prompt) | set(output):  # repetition first (vLLM's order)
            if rp != 1.0:
                ref[tok] = ref[tok] / rp if ref[tok] > 0 else ref[tok] * rp
        for tok, count in Counter(output).items():  # output tokens only
            ref[tok] -= fp * count + pp * (count > 0)
        torch.testing.assert_close(got[i].double(), ref, rtol=0, atol=1e-5)
    # Prompt-only tokens are not touched by presence/frequency.
    assert got[0, 1] == logits[0, 1] and got[1, 4] == logits[1, 4]


def test_penalties_change_the_greedy_choice_in_the_sampler():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    base = Sampler()(logits.clone(), [SamplingRow(SamplingParams(temperature=0), None, [], [0, 0])])
    assert base.token_ids == [0]
    for kwargs in ({"frequency_penalty": 0.1}, {"presence_penalty": 0.2}, {"repetition_penalty": 1.1}):
        params = SamplingParams(temperature=0, logprobs=0, **kwargs)
        out = Sampler()(logits.clone(), [SamplingRow(params, None, [], [0, 0])])
        assert out.token_ids == [1], kwargs
        # Reported logprobs stay those of the raw model distribution.
        assert out.logprobs[0] == pytest.approx(float(logits.log_softmax(-1)[0, 1]))


def test_sampler_skips_logprobs_nobody_asked_for():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0], [0.0, 1.0, 1.0, 0.5]])
    rows = [SamplingRow(SamplingParams(temperature=0), None, [], []) for _ in range(2)]
    out = Sampler()(logits.clone(), rows)
    assert out.token_ids == [0, 1]  # ties resolve to the first maximal id, as argmax
    assert out.logprobs is None and out.ranks is None
    rows[1] = SamplingRow(SamplingParams(temperature=0, logprobs=1), None, [], [])
    out = Sampler()(logits.clone(), rows)
    assert out.logprobs == pytest.approx(logits.log_softmax(-1)[[0, 1], [0, 1]].tolist())
    assert out.top_ids[1] == [1]


def test_repetition_penalty_end_to_end_matches_hf_generate(tiny_ckpt):
    prompt = "Tell me a long story about the sea"
    model, processor = _hf_model(str(tiny_ckpt))
    inputs = processor(text=prompt, return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=24, do_sample=False, repetition_penalty=1.4)
    ref = ref[0, inputs["input_ids"].shape[1]:].tolist()
    llm = get_llm(tiny_ckpt)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.4),
                       use_tqdm=False)[0].outputs[0]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: len(out.token_ids)]
    assert len(out.token_ids) == len(ref) or out.finish_reason == "stop"
    assert out.token_ids != plain.token_ids  # the penalty mattered


def test_min_tokens_mask_in_the_sampler():
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]] * 3)
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]).clone(eos_token_ids=(2,))
    rows = [SamplingRow(p, None, [], []), SamplingRow(p, None, [], [4, 4]),
            SamplingRow(p.clone(ignore_eos=True), None, [], [4])]
    assert Sampler()(logits, rows).token_ids == [4, 2, 2]


# ---------------------------------------------------------------------------------------------
# Batched: one filter pass over all sampled rows
# ---------------------------------------------------------------------------------------------

def test_sampling_is_one_batched_pass(monkeypatch):
    calls = []
    real = sampler_mod.filter_logits

    def spy(logits, top_k, top_p, min_p):
        calls.append(tuple(logits.shape))
        return real(logits, top_k, top_p, min_p)

    monkeypatch.setattr(sampler_mod, "filter_logits", spy)
    vocab = 1000
    kinds = [SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.0, top_p=0.5),
             SamplingParams(temperature=0), SamplingParams(temperature=1.2, min_p=0.1, presence_penalty=0.5)]
    rows = [SamplingRow(kinds[i % 4], torch.Generator().manual_seed(i) if i % 3 else None, [1, 2], [3])
            for i in range(64)]
    out = Sampler()(torch.randn(64, vocab), rows)
    assert calls == [(48, vocab)]  # the 48 non-greedy rows, together, once
    assert len(out.token_ids) == 64
