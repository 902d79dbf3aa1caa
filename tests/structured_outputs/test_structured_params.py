"""StructuredOutputsParams validation, the OpenAI field conversion, and the xgrammar backend
pieces (compile cache, matchers, batch bitmask, fork, rollback, EOS) on a tiny tokenizer."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import DEVICES
from mmkit import SamplingParams, StructuredOutputsParams
from mmkit.structured_outputs.openai import structured_outputs_from_openai

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["a"]}


def test_import_mmkit_does_not_import_xgrammar():
    code = ("import sys, mmkit; from mmkit import SamplingParams, LLM; "
            "assert 'xgrammar' not in sys.modules, 'xgrammar imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kwargs, field, fragment", [
    ({}, "StructuredOutputsParams", "no constraint"),
    ({"choice": ["a"], "regex": "a"}, "StructuredOutputsParams", "choice and regex at once"),
    ({"json": SCHEMA, "json_object": True}, "StructuredOutputsParams", "json and json_object"),
    ({"choice": []}, "choice", "empty list"),
    ({"choice": "yes"}, "choice", "non-empty list of strings"),
    ({"choice": ["a", ""]}, "choice[1]", "non-empty string"),
    ({"choice": ["a", 3]}, "choice[1]", "non-empty string"),
    ({"regex": "[0-9"}, "regex", "Unclosed"),
    ({"regex": ""}, "regex", "non-empty string"),
    ({"json": {"type": "intger"}}, "json", "intger"),
    ({"json": '{"type": "object"'}, "json", "not JSON"),
    ({"json": [1, 2]}, "json", "expected a JSON schema"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 3}}, "json", "minimum greater than maximum"),
    ({"grammar": "root ::= foo"}, "grammar", "not defined"),
    ({"json_object": "yes"}, "json_object", "expected True"),
    ({"regex": "a", "disable_any_whitespace": "no"}, "disable_any_whitespace", "True or False"),
])
def test_bad_params_name_the_field(kwargs, field, fragment):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**kwargs)
    assert str(info.value).startswith(field) and fragment in str(info.value), str(info.value)


def test_good_params_and_spec_keys():
    assert StructuredOutputsParams(json=SCHEMA).spec == StructuredOutputsParams(json=json.dumps(SCHEMA)).spec
    assert StructuredOutputsParams(json=SCHEMA).spec != StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=False).spec
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]
    assert StructuredOutputsParams(json_object=True, regex=None).kind == "json_object"
    assert StructuredOutputsParams(grammar='start: "x" | "y"').spec.kind == "lark"
    assert StructuredOutputsParams(grammar='root ::= "x" | "y"').spec.kind == "grammar"
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        name: str
        price: float

    assert json.loads(StructuredOutputsParams(json=Item).spec.text)["required"] == ["name", "price"]
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    assert sp.clone(temperature=0).structured_outputs is sp.structured_outputs
    with pytest.raises(TypeError, match="structured_outputs: got dict"):
        SamplingParams(structured_outputs={"regex": "a+"})


def test_openai_response_format_and_extra_body():
    assert structured_outputs_from_openai() is None
    assert structured_outputs_from_openai(response_format={"type": "text"}) is None
    assert structured_outputs_from_openai(response_format={"type": "json_object"}).json_object is True
    p = structured_outputs_from_openai(response_format={
        "type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}})
    assert p.json == SCHEMA
    assert structured_outputs_from_openai(structured_outputs={"choice": ["yes", "no"]}).choice == ["yes", "no"]
    assert structured_outputs_from_openai(structured_outputs={"regex": "[0-9]+"}).regex == "[0-9]+"
    p = structured_outputs_from_openai(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False})
    assert p.json == SCHEMA and not p.disable_any_whitespace
    assert structured_outputs_from_openai(guided_choice=["a", "b"]).choice == ["a", "b"]


@pytest.mark.parametrize("kwargs, message", [
    ({"response_format": {"type": "xml"}}, "response_format.type: got 'xml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema: got None"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name: got None"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema: missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "intger"}}}},
     "response_format.json_schema.schema: got {'type': 'intger'}"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": 1}}},
     "response_format.json_schema.strict: got 1"),
    ({"response_format": "json"}, "response_format: got str"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice: got an empty list"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex: got '(a'"),
    ({"structured_outputs": {}}, "structured_outputs: got no constraint"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag: not supported"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
     "response_format and structured_outputs: got two output constraints"),
])
def test_openai_bad_fields(kwargs, message):
    with pytest.raises(ValueError) as info:
        structured_outputs_from_openai(**kwargs)
    assert str(info.value).startswith(message), str(info.value)


# ---------------------------------------------------------------------- backend pieces
@pytest.fixture(scope="module")
def backend(tiny_ckpt):
    from transformers import AutoTokenizer

    from mmkit.structured_outputs.backend import StructuredOutputBackend

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    # A padded LM head: 8 ids past the tokenizer that no grammar may ever allow.
    return StructuredOutputBackend(tok, len(tok) + 8, (tok.eos_token_id,)), tok


def _allowed(logits):
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def test_compile_cache_keyed_by_spec(backend):
    be, _ = backend
    before = be.num_compiles
    params = [StructuredOutputsParams(json=dict(SCHEMA)) for _ in range(100)]
    compiled = {id(be.compile(p)) for p in params}
    assert len(compiled) == 1 and be.num_compiles == before + 1
    be.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=False))
    assert be.num_compiles == before + 2


def test_batch_bitmask_advance_fork_rollback_and_eos(backend):
    from mmkit.structured_outputs.bitmask import GrammarBitmask

    be, tok = backend
    vocab = be.vocab_size
    eos = tok.eos_token_id
    state = be.new_request(StructuredOutputsParams(choice=["12", "7"]))
    other = be.new_request(StructuredOutputsParams(regex="[a-z]"))
    mask = GrammarBitmask()
    logits = torch.zeros(3, vocab)
    mask.apply(logits, [state.matcher, other.matcher], [0, 2])  # row 1: unconstrained
    allowed = _allowed(logits)
    decoded0 = {tok.decode([t]) for t in allowed[0]}
    assert decoded0 and all(d in ("1", "12", "7") for d in decoded0)
    assert allowed[1] == set(range(vocab))
    assert all(tok.decode([t]) in "abcdefghijklmnopqrstuvwxyz" and len(tok.decode([t])) == 1 for t in allowed[2])
    assert all(t < len(tok) for t in allowed[0] | allowed[2]) and eos not in allowed[0]

    one = tok.convert_tokens_to_ids("1")
    assert state.accept(one) and not state.is_completed()
    child = state.rebuild([one])  # a matcher of its own at the same position
    two = tok.convert_tokens_to_ids("2")
    assert child.accept(two) and child.is_completed()
    assert not state.is_completed()  # the copy is independent
    logits = torch.zeros(1, vocab)
    mask.apply(logits, [child.matcher], [0])
    assert _allowed(logits)[0] == {eos}  # EOS exactly when complete, and nothing else
    assert not child.accept(one)
    assert child.accept(eos) and child.is_terminated()
    child.rollback(2)
    assert child.num_accepted == 1 and not child.is_completed()
    rebuilt = state.rebuild([one, two])
    assert rebuilt.is_completed() and rebuilt.num_accepted == 2


@pytest.mark.parametrize("vocab, dtype", [(384 + 8, torch.float32), (49152 + 5, torch.float32),
                                          (49152 + 5, torch.bfloat16), (1000, torch.float16)])
def test_cpu_bitmask_kernel_equals_xgrammar(vocab, dtype):
    import xgrammar as xgr

    from mmkit.layers import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("no C compiler: the sampler uses xgrammar's kernel")
    gen = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # everything allowed
    bitmask[2] = 0  # nothing allowed
    bitmask[3, : words // 2] = 0
    full = torch.randn(6, vocab + 3, generator=gen).to(dtype)
    base = full[:, :vocab].clone()
    indices = [0, 2, 3, 5]
    ours, ref = full.clone()[:, :vocab], base.clone()  # ours: strided rows
    assert ours.stride(0) == vocab + 3
    assert cpu_kernels.apply_token_bitmask(ours, bitmask, indices)
    xgr.apply_token_bitmask_inplace(ref, bitmask, indices=indices, vocab_size=vocab, backend="torch_native")
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 4]], base[[1, 4]]) and torch.isinf(ours[2]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_grammar_bitmask_on_each_device(backend, device):
    """The sampler's mask on CPU (mmkit's C kernel or xgrammar's) and CUDA (xgrammar's kernel)."""
    from mmkit.structured_outputs.bitmask import GrammarBitmask

    be, tok = backend
    states = [be.new_request(StructuredOutputsParams(choice=["12", "7"])),
              be.new_request(StructuredOutputsParams(json=SCHEMA))]
    logits = torch.randn(3, be.vocab_size, generator=torch.Generator().manual_seed(0))
    ref = logits.clone()
    GrammarBitmask().apply(ref, [s.matcher for s in states], [0, 2])
    got = logits.to(device)
    GrammarBitmask().apply(got, [s.matcher for s in states], [0, 2])
    assert torch.equal(got.cpu(), ref) and torch.equal(ref[1], logits[1])
    assert {tok.decode([t]) for t in torch.isfinite(ref[2]).nonzero().flatten().tolist()} == {"{"}
