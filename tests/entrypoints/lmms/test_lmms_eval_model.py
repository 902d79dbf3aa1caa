"""mmkit as an lmms-eval model, in process: log-likelihood against transformers, one batched
generate per call, multi-round, model_args parsing, the entry point, and the extra kept out of
the core install. (The shipped tasks through the `lmms-eval` command: test_lmms_eval_tasks.py.)"""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from conftest import make_image

pytest.importorskip("lmms_eval", reason="needs the lmms-eval extra: pip install -e '.[lmms-eval]'")
from lmms_eval.api.instance import Instance  # noqa: E402

from mmkit.entrypoints.lmms.args import parse_value, split_model_args  # noqa: E402
from mmkit.entrypoints.lmms.model import MMKit  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def _instance(kind: str, args: tuple, idx: int = 0) -> Instance:
    return Instance(request_type=kind, arguments=args, idx=idx, metadata={"task": "t", "doc_id": 0, "repeats": 1})


def _with_docs(model: MMKit, docs: list[dict]) -> MMKit:
    model.task_dict = {"t": {"test": docs}}
    return model


def test_entry_point_registers_a_simple_class():
    from lmms_eval.models import get_model
    from lmms_eval.models.registry_v2 import ModelRegistryV2

    registry = ModelRegistryV2()
    registry.load_entrypoint_manifests()
    manifest = registry.get_manifest("mmkit")
    assert manifest.simple_class_path == "mmkit.entrypoints.lmms.model.MMKit" and manifest.chat_class_path is None
    assert get_model("mmkit") is MMKit


def test_model_args_parse_json_and_split():
    assert parse_value('{"image": 2}') == {"image": 2} and parse_value("bfloat16") == "bfloat16"
    engine, options = split_model_args({"dtype": "bfloat16", "max_num_seqs": 64, "batch_size": 1,
                                        "limit_mm_per_prompt": '{"image":2}', "max_new_tokens": 32})
    assert engine == {"dtype": "bfloat16", "max_num_seqs": 64, "limit_mm_per_prompt": {"image": 2}}
    assert options["max_new_tokens"] == 32
    with pytest.raises(ValueError, match="unknown argument 'bogus'"):
        split_model_args({"bogus": 1})


def _hf_scores(path, prompt_ctx: str, continuation: str, image) -> tuple[float, bool]:
    """transformers' own -sum log_softmax of the continuation's tokens, and greedy agreement."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    full = processor(text=prompt_ctx + continuation, images=[image], return_tensors="pt")
    n_ctx = processor(text=prompt_ctx, images=[image], return_tensors="pt")["input_ids"].shape[1]
    with torch.no_grad():
        logits = model(**full).logits[0].float()
    ids = full["input_ids"][0]
    logp = logits[n_ctx - 1:-1].log_softmax(-1)
    cont = ids[n_ctx:]
    return -float(logp.gather(1, cont[:, None]).sum()), bool((logp.argmax(-1) == cont).all())


def test_loglikelihood_matches_transformers(tiny_ckpt):
    from transformers import AutoProcessor

    image = make_image(3)
    docs = [{"image": image}]
    model = _with_docs(MMKit(model=str(tiny_ckpt), dtype="float32", seed=0, threads=2), docs)
    options = [" a", " b c", " hello world", " a"]
    reqs = [_instance("loglikelihood", ("Describe it.", opt, lambda d: [d["image"]], 0, "t", "test"), i)
            for i, opt in enumerate(options)]
    hits_before = model.llm.get_metrics()["prefix_cache_hits"]
    results = model.loglikelihood(reqs)
    # The four options share the context: later ones read it from the prefix cache.
    assert model.llm.get_metrics()["prefix_cache_hits"] > hits_before
    processor = AutoProcessor.from_pretrained(tiny_ckpt)
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    ctx = processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    bos = processor.tokenizer.bos_token
    ctx = ctx[len(bos):] if bos and ctx.startswith(bos) else ctx
    for opt, res in zip(options, results):
        nll, greedy = res.text
        ref_nll, ref_greedy = _hf_scores(tiny_ckpt, ctx, opt, image)
        assert abs(nll - ref_nll) < 1e-4 and greedy == ref_greedy, (opt, nll, ref_nll)
    assert results[0].text == results[3].text
    # A continuation equal to the greedy reply is greedy and scores as its own tokens do.
    from mmkit import SamplingParams

    reply = model.llm.generate(model._prompt([image], [], "Describe it."),
                               SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    text = reply[0].outputs[0].text
    (nll, greedy), = [r.text for r in model.loglikelihood(
        [_instance("loglikelihood", ("Describe it.", text, lambda d: [d["image"]], 0, "t", "test"))])]
    ref_nll, ref_greedy = _hf_scores(tiny_ckpt, ctx, text, image)
    assert ref_greedy and greedy and abs(nll - ref_nll) < 1e-4
    # acc_mutual_info's unconditional requests: (context, continuation) only.
    (nll, _), = [r.text for r in model.loglikelihood([_instance("loglikelihood", ("", " a"))])]
    assert nll > 0


@pytest.fixture(scope="module")
def default_model():
    return MMKit(threads=2)


def test_200_requests_are_one_batched_generate(default_model, monkeypatch):
    docs = [{"image": make_image(i % 7, 64, 64)} for i in range(200)]
    model = _with_docs(default_model, docs)
    calls = []
    real = model.llm.generate

    def counting(inputs, params=None, **kw):
        calls.append((len(inputs), params))
        return real(inputs, params, **kw)

    monkeypatch.setattr(model.llm, "generate", counting)
    reqs = [_instance("generate_until", ("Describe the image.", {"max_new_tokens": 1 + i % 3, "until": ["\n"]},
                                         lambda d: [d["image"]], i, "t", "test")) for i in range(200)]
    outs = model.generate_until(reqs)
    assert len(calls) == 1 and calls[0][0] == 200
    assert [p.max_tokens for p in calls[0][1]] == [1 + i % 3 for i in range(200)]
    assert all(o.token_counts.output_tokens <= 1 + i % 3 for i, o in enumerate(outs))


def test_generate_until_multi_round(default_model):
    docs = [{"image": make_image(1, 64, 64)}, {"image": make_image(2, 64, 64)}]
    model = _with_docs(default_model, docs)
    seen = []

    def doc_to_text(doc, previous_output, round_idx, previous_round_info):
        seen.append((round_idx, list(previous_output), previous_round_info))
        done = round_idx == 2
        return [doc["image"]], "How many shapes are there?", done, previous_output, {"round": round_idx}

    reqs = [_instance("generate_until_multi_round", ("Describe the image.", {"max_new_tokens": 8},
                                                     lambda d: [d["image"]], doc_to_text, i, "t", "test"))
            for i in range(2)]
    out = model.generate_until_multi_round(reqs)
    assert [len(o) for o in out] == [2, 2] and all(isinstance(t, str) for o in out for t in o)
    assert [r for r, _p, _i in seen] == [1, 1, 2, 2] and seen[2][2] == {"round": 1}


def test_extra_stays_out_of_core_install_and_import():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "lmms" not in core and "filelock" not in core and "datasets" not in core
    extras = project["optional-dependencies"]
    assert "lmms-eval==0.7.3" in extras["lmms-eval"] and "filelock<4" in extras["lmms-eval"]
    assert any("lmms-eval" in d for d in extras["test"])
    # lmms-eval 0.7.3 pins av<16 and protobuf<7: mmkit's own extras must not require newer.
    assert not any(d.replace(" ", "").startswith(("av>=16", "av>16", "protobuf>=7")) for e in extras.values() for d in e)
    code = ("import sys, mmkit; from mmkit import LLM, SamplingParams; import mmkit.eval.scoring; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'lmms_eval', 'datasets', 'evaluate', 'sacrebleu', 'wandb'})))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert json.loads(out) == []
