"""Row -> request -> output columns (the logic inside each Ray replica), without Ray."""

import io

import pytest

from conftest import get_llm, make_image, break_pixels_of_width
from mmkit import SamplingParams
from mmkit.ray.batch_rows import OUTPUT_COLUMNS, row_params, run_rows
from mmkit.multimodal.image_io import load_image_bytes

PROMPT = "USER: <image>\nWhat is it? ASSISTANT:"
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def png_bytes(seed: int) -> bytes:
    buf = io.BytesIO()
    make_image(seed).save(buf, format="PNG")
    return buf.getvalue()


def test_rows_match_generate_and_bad_rows_carry_errors(tiny_ckpt, tmp_path):
    llm = get_llm(tiny_ckpt)
    path = tmp_path / "a.png"
    make_image(3).save(path)
    rows = [
        {"prompt": "Hello there"},
        {"prompt": PROMPT, "image": png_bytes(1)},
        {"prompt": PROMPT, "image": str(path), "sampling_params": {"max_tokens": 2, "temperature": None}},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
         "image": png_bytes(2)},
        {"messages": [{"role": "user", "content": "What?"}], "image": [png_bytes(2)]},  # image goes first
        {"prompt": PROMPT, "image": b"\x89PNG\r\n\x1a\nnot really"},
        {"prompt": "   "},
        {"prompt": "Hi", "sampling_params": {"max_tokens": 0}},
        {"prompt": "Hi", "sampling_params": {"max_tokns": 3}},
        {"prompt": PROMPT},  # a placeholder and no image
        {"image": png_bytes(1)},
        {"prompt": "Hi", "choices": []},
        {"prompt": "Hi there", "choices": ["yes", "no", "a circle"]},
    ]
    outs = run_rows(llm, rows, GREEDY, max_in_flight=3)
    assert len(outs) == len(rows) and all(set(o) == set(OUTPUT_COLUMNS) for o in outs)
    ref = llm.generate([
        "Hello there",
        {"prompt": PROMPT, "multi_modal_data": {"image": load_image_bytes(png_bytes(1), where="x")}},
        {"prompt": PROMPT, "multi_modal_data": {"image": make_image(3)}},
    ], [GREEDY, GREEDY, GREEDY.clone(max_tokens=2)], use_tqdm=False)
    ref += llm.chat([{"role": "user", "content": [{"type": "image", "image": make_image(2)},
                                                  {"type": "text", "text": "What?"}]}], GREEDY, use_tqdm=False) * 2
    for out, r in zip(outs, ref):
        assert out["error"] is None
        assert out["generated_tokens"] == list(r.outputs[0].token_ids)
        assert out["generated_text"] == r.outputs[0].text
        assert out["finish_reason"] == r.outputs[0].finish_reason
        assert out["num_input_tokens"] == len(r.prompt_token_ids)
        assert out["num_generated_tokens"] == len(r.outputs[0].token_ids)
    errors = [o["error"] for o in outs[5:]]
    assert "image[0]" in errors[0] and "corrupt" in errors[0]
    assert errors[1].startswith("prompt: got '   '")
    assert errors[2].startswith("sampling_params.max_tokens: got 0")
    assert "max_tokns" in errors[3] and "unknown field" in errors[3]
    assert "placeholder" in errors[4]
    assert "neither of 'prompt' and 'messages'" in errors[5]
    assert errors[6].startswith("choices: got []; expected a non-empty list")
    # choices: constrained to one option verbatim (structured outputs; a leading space is dropped),
    # with the same tokens as LLM.generate under `mmkit eval`'s choice constraint.
    from mmkit.eval.evaluation import choice_params

    constrained = llm.generate("Hi there", choice_params(GREEDY, ["yes", "no", "a circle"]), use_tqdm=False)[0]
    assert outs[-1]["error"] is None and outs[-1]["generated_text"] in ("yes", "no", "a circle")
    assert outs[-1]["generated_tokens"] == list(constrained.outputs[0].token_ids)
    assert outs[-1]["generated_text"] == constrained.outputs[0].text.removeprefix(" ")
    for o in outs[5:-1]:
        assert o["generated_text"] is None and o["num_generated_tokens"] is None
    assert not llm.llm_engine.has_unfinished_requests()


def test_row_params_ignores_arrow_nulls_and_keeps_the_default():
    params = row_params("", {"sampling_params": {"max_tokens": 7, "top_k": None}}, GREEDY)
    assert params.max_tokens == 7 and params.temperature == 0 and params.top_k == -1
    assert row_params("", {}, None) == SamplingParams()
    with pytest.raises(TypeError, match="sampling_params: got str"):
        row_params("", {"sampling_params": "greedy"}, None)


def test_import_mmkit_stays_light():
    import subprocess
    import sys

    code = ("import sys, mmkit, mmkit.ray.batch_rows, mmkit.entrypoints.cli.main; mmkit.entrypoints.cli.main.build_parser(); "
            "print(sorted(m for m in ('ray', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_build_processor_and_eval_ray_reject_bad_arguments_before_starting_ray(tmp_path, capsys):
    pytest.importorskip("ray")
    import ray

    from mmkit.entrypoints.cli.main import main
    from mmkit.ray import build_processor

    with pytest.raises(ValueError, match="concurrency: got 0; expected an integer >= 1"):
        build_processor(concurrency=0)
    with pytest.raises(ValueError, match="num_cpus_per_replica: got -1"):
        build_processor(num_cpus_per_replica=-1)
    with pytest.raises(TypeError, match="max_num_sequences"):
        build_processor(max_num_sequences=4)  # an EngineArgs typo fails here, not inside an actor
    with pytest.raises(TypeError, match="sampling_params: got int"):  # a dict of fields is accepted now
        build_processor(None, 4)
    assert main(["eval", str(tmp_path / "missing.parquet"), "--ray", "--output", str(tmp_path / "r.jsonl")]) == 2
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not parquet")
    assert main(["eval", str(tmp_path / "bad.parquet"), "--ray", "--output", str(tmp_path / "r.jsonl")]) == 2
    assert not ray.is_initialized()
    err = capsys.readouterr().err
    assert "missing.parquet' does not exist" in err and "bad.parquet" in err and "Traceback" not in err


def test_row_whose_image_fails_at_scheduling_carries_the_error(tiny_ckpt, monkeypatch):
    """An image that decodes but fails in the image processor (when its request is scheduled)
    ends that row alone with `error`; the other rows equal `LLM.generate`."""
    from mmkit import LLM

    llm = LLM(str(tiny_ckpt), dtype="float32")
    break_pixels_of_width(monkeypatch, llm.llm_engine.input_processor, 13)
    bad = io.BytesIO()
    make_image(5, width=13).save(bad, format="PNG")
    rows = [{"prompt": PROMPT, "image": png_bytes(1)}, {"prompt": PROMPT, "image": bad.getvalue()},
            {"prompt": "Hello there"}]
    out = run_rows(llm, rows, GREEDY)
    assert out[1]["error"] is not None and "broken image data" in out[1]["error"]
    assert out[1]["generated_text"] is None and out[1]["finish_reason"] is None
    ref = get_llm(tiny_ckpt).generate(
        [{"prompt": PROMPT, "multi_modal_data": {"image": load_image_bytes(png_bytes(1), where="ref")}}, "Hello there"],
        GREEDY, use_tqdm=False)
    assert [out[0]["generated_tokens"], out[2]["generated_tokens"]] == [list(o.outputs[0].token_ids) for o in ref]
    assert out[0]["error"] is None and out[2]["error"] is None
