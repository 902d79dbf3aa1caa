"""Stop strings, stop token ids, EOS handling (ignore_eos, min_tokens) and incremental
detokenization (byte-level BPE and a sentencepiece-style tokenizer)."""

import random
from functools import lru_cache

import pytest
import torch

from conftest import _hf_model, get_llm
from mmkit import SamplingParams
from mmkit.engine import detokenizer
from mmkit.engine.output_processor import SeqOutputState

STORY = "Tell me a long story about the sea number 3"
FFFD = "\ufffd"


def greedy(llm, prompt, max_tokens=40, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


@lru_cache(maxsize=4)
def eos_prompt(path):
    """A token-id prompt whose greedy output hits EOS after 3..12 tokens (searched, seeded)."""
    llm = get_llm(path)
    eos = llm.get_tokenizer().eos_token_id
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(5, 384) for _ in range(rng.randrange(2, 12))] for _ in range(300)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        if c.finish_reason == "stop" and 3 <= len(c.token_ids) <= 12:
            assert c.token_ids[-1] == eos and c.stop_reason is None
            return tuple(p), tuple(c.token_ids)
    raise AssertionError("no prompt of the tiny model reaches EOS early")


def spanning_stop(tok, ids):
    """A stop string made of the end of token i and the start of token i+1, first matched
    exactly when token i+1 arrives. Returns (stop, i + 1, char offset of the match)."""
    for i in range(2, len(ids) - 1):
        a, b = tok.decode([ids[i]]), tok.decode([ids[i + 1]])
        before, upto_a, upto_b = (tok.decode(ids[:i]), tok.decode(ids[:i + 1]), tok.decode(ids[:i + 2]))
        if FFFD in a + b or upto_a != before + a or upto_b != upto_a + b:
            continue
        stop = a[-2:] + b[:1]
        if len(stop) >= 2 and stop not in upto_a and upto_b.find(stop) == len(upto_a) - len(a[-2:]):
            return stop, i + 1, upto_b.find(stop)
    raise AssertionError("no clean token boundary in the greedy text")


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return get_llm(tiny_ckpt)


# ---------------------------------------------------------------------------------------------
# Stop strings and stop token ids
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(llm, include):
    tok = llm.get_tokenizer()
    ref = greedy(llm, "USER: hi ASSISTANT:")
    ids = ref.token_ids
    stop, last, offset = spanning_stop(tok, ids)
    out = greedy(llm, "USER: hi ASSISTANT:", stop=[stop, "never-appears-zz"], include_stop_str_in_output=include)
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.token_ids == ids[:last + 1]  # generation stopped at the token completing the match
    full = tok.decode(ids[:last + 1])
    expected = full[:offset + len(stop)] if include else full[:offset]
    assert out.text == expected
    assert out.text.endswith(stop) == include and (stop in out.text) == include


def test_stop_string_inside_one_token(llm):
    tok = llm.get_tokenizer()
    ids = greedy(llm, STORY).token_ids
    # A token whose text has 2+ clean characters; its first occurrence.
    j = next(j for j, t in enumerate(ids) if len(tok.decode([t])) >= 2 and FFFD not in tok.decode([t])
             and tok.decode(ids[:j + 1]) == tok.decode(ids[:j]) + tok.decode([t])
             and tok.decode([t]) not in tok.decode(ids[:j]))
    stop = tok.decode([ids[j]])
    out = greedy(llm, STORY, stop=stop)
    assert out.token_ids == ids[:j + 1] and out.stop_reason == stop and out.finish_reason == "stop"
    assert out.text == tok.decode(ids[:j])


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids(llm, include):
    tok = llm.get_tokenizer()
    ids = greedy(llm, STORY).token_ids
    j = next(j for j in range(3, len(ids)) if ids[j] not in ids[:j])
    out = greedy(llm, STORY, stop_token_ids=[ids[j]], include_stop_str_in_output=include)
    assert out.finish_reason == "stop" and out.stop_reason == ids[j]
    assert out.token_ids == ids[:j + 1]
    assert out.text == tok.decode(ids[:j + 1] if include else ids[:j])


def test_max_tokens_is_length(llm):
    out = greedy(llm, STORY, max_tokens=7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length" and out.stop_reason is None


def test_eos_stops_and_ignore_eos_generates_max_tokens(llm, tiny_ckpt):
    prompt, eos_run = eos_prompt(str(tiny_ckpt))
    eos = llm.get_tokenizer().eos_token_id
    out = llm.generate({"prompt_token_ids": list(prompt)}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length"
    assert out.token_ids[:len(eos_run)] == list(eos_run) and eos in out.token_ids


def test_min_tokens_suppresses_eos_like_hf(llm, tiny_ckpt):
    prompt, eos_run = eos_prompt(str(tiny_ckpt))
    eos = llm.get_tokenizer().eos_token_id
    min_tokens = len(eos_run) + 6
    out = llm.generate({"prompt_token_ids": list(prompt)},
                       SamplingParams(temperature=0, max_tokens=24, min_tokens=min_tokens),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= min_tokens
    assert eos not in out.token_ids[:min_tokens]
    assert out.token_ids[:len(eos_run) - 1] == list(eos_run[:-1])
    model, _ = _hf_model(str(tiny_ckpt))
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=24, min_new_tokens=min_tokens, do_sample=False)
    assert out.token_ids == ref[0, len(prompt):].tolist()


def test_min_tokens_also_holds_back_stop_token_ids(llm):
    ids = greedy(llm, STORY).token_ids
    j = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j])
    out = greedy(llm, STORY, stop_token_ids=[ids[j]], min_tokens=j + 4, max_tokens=j + 10)
    assert ids[j] not in out.token_ids[:j + 4]
    assert len(out.token_ids) >= j + 4


# ---------------------------------------------------------------------------------------------
# Detokenization
# ---------------------------------------------------------------------------------------------

def test_final_text_equals_tokenizer_decode_with_partial_characters(llm):
    tok = llm.get_tokenizer()
    prompts = [STORY, "café naïve", "日本語 😀", "USER: hi ASSISTANT:"]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, n=2),
                        use_tqdm=False)
    lone_fffd = 0
    for o in outs:
        for c in o.outputs:
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
            lone_fffd += sum(tok.decode([t]) == FFFD for t in c.token_ids)
    assert lone_fffd > 10  # the byte-level model really emitted partial-character tokens


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_in_output(llm, skip):
    tok = llm.get_tokenizer()
    specials = set(tok.all_special_ids)
    outs = llm.generate(STORY, SamplingParams(temperature=1.0, seed=11, n=8, max_tokens=40, ignore_eos=True,
                                              skip_special_tokens=skip), use_tqdm=False)[0].outputs
    assert any(specials & set(c.token_ids) for c in outs)
    for c in outs:
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=skip)
        if not skip and specials & set(c.token_ids):
            assert any(tok.convert_ids_to_tokens(t) in c.text for t in specials & set(c.token_ids))


def _byte_token_ids(tok, data: bytes):
    # GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    ids = tok.convert_tokens_to_ids([table[b] for b in data])
    assert tok.unk_token_id not in ids
    return ids


def _stream(tok, ids, params, num_prompt=0):
    """Feed `ids` one token at a time; return the text after each step."""
    prompt = list(range(5, 5 + num_prompt))
    seq = SeqOutputState(index=0, token_ids=list(prompt), num_prompt_tokens=num_prompt)
    texts = []
    for t in ids:
        seq.token_ids.append(t)
        before = seq.output_text
        delta = detokenizer.decode_incrementally(tok, seq, params)
        assert seq.output_text == before + delta
        texts.append(seq.output_text)
    return seq, texts


@pytest.mark.parametrize("num_prompt", [0, 3])
def test_decode_incrementally_holds_back_partial_characters(llm, num_prompt):
    tok = llm.get_tokenizer()
    params = SamplingParams()
    text = "a😀é日 ok"
    ids = _byte_token_ids(tok, text.encode())  # one token per byte: characters split across tokens
    seq, texts = _stream(tok, ids, params, num_prompt)
    assert texts[0] == "a"
    assert texts[1:4] == ["a", "a", "a"]  # 😀 is 4 bytes: held back until complete
    assert texts[4] == "a😀"
    assert all(FFFD not in t for t in texts) and texts[-1] == text
    for prev, nxt in zip(texts, texts[1:]):
        assert nxt.startswith(prev)
    # A trailing incomplete character is held back, then flushed as U+FFFD at the end.
    tail = _byte_token_ids(tok, "日".encode())[:2]
    for t in tail:
        seq.token_ids.append(t)
        assert detokenizer.decode_incrementally(tok, seq, params) == ""
    assert seq.output_text == text
    detokenizer.flush(tok, seq, params, drop_last=False)
    assert seq.output_text == tok.decode(ids + tail) == text + FFFD


def test_decode_incrementally_matches_decode_on_real_tokens(llm):
    tok = llm.get_tokenizer()
    for text in ["café naïve über 日本語 😀 emoji", "The quick brown fox 😀😀 jumps"]:
        ids = tok.encode(text, add_special_tokens=False)
        _, texts = _stream(tok, ids, SamplingParams())
        assert texts[-1] == tok.decode(ids) == text
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def _sentencepiece_style_tokenizer():
    """A Llama-style tokenizer (Metaspace, byte fallback, the Llama decoder) built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzé":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "h"), ("l", "l"), ("▁h", "e"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"), ("o", "r")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tk = Tokenizer(model)
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(content=" ", left=1, right=0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_decode_incrementally_sentencepiece_style():
    tok = _sentencepiece_style_tokenizer()
    text = "hello world café 日本 😀 end"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte fallback used
    assert tok.decode(ids) == text
    _, texts = _stream(tok, ids, SamplingParams())
    assert texts[-1] == text  # leading spaces of later pieces are kept
    assert all(b.startswith(a) and FFFD not in b for a, b in zip(texts, texts[1:]))
    assert "hello world" in texts[ids.index(tok.convert_tokens_to_ids("▁w")) + 5]


def test_stop_strings_are_not_checked_before_min_tokens(llm):
    tok = llm.get_tokenizer()
    ids = greedy(llm, STORY).token_ids
    j = next(j for j, t in enumerate(ids) if len(tok.decode([t])) >= 2 and FFFD not in tok.decode([t]))
    stop = tok.decode([ids[j]])
    out = greedy(llm, STORY, stop=stop, min_tokens=j + 3, max_tokens=40)
    assert len(out.token_ids) >= j + 3 and out.token_ids[:j + 1] == ids[:j + 1]
