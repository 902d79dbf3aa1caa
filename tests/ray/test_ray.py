"""mmkit.ray and `mmkit eval --ray` on a local Ray with 2 CPUs (one Ray session for the module).

Ray and its actors take seconds to start on a small machine, so the tests are few and each
checks a whole path: the quick-start set against the single-process run, 200 mixed rows
against LLM.generate, a killed and resumed run, Parquet with image bytes.
"""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from conftest import get_llm, make_image  # noqa: E402
from mmkit import SamplingParams  # noqa: E402
from mmkit.multimodal.image_io import load_image_bytes  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "assets" / "eval" / "quickstart.jsonl"
PROMPT = "USER: <image>\nWhat is it? ASSISTANT:"


def mmkit(*args, timeout=600):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", RAY_ADDRESS="")
    return subprocess.run([sys.executable, "-m", "mmkit", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def read_results(path):
    return {r["index"]: r for r in map(json.loads, Path(path).read_text().splitlines())}


def image_bytes(seed, fmt="PNG"):
    buf = io.BytesIO()
    make_image(seed).save(buf, format=fmt)
    return buf.getvalue()


def test_eval_ray_matches_single_process(tmp_path):
    """The issue's command (local Ray started by the command itself) against the plain run."""
    from mmkit.entrypoints.cli.main import main

    single = tmp_path / "single.jsonl"
    assert main(["eval", str(QUICKSTART), "--output", str(single), "--no-progress"]) == 0
    out = mmkit("eval", str(QUICKSTART), "--ray", "--concurrency", "2", "--output", str(tmp_path / "ray.jsonl"),
                "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "throughput: 48 items in" in out.stdout and "items/s" in out.stdout and "tokens/s" in out.stdout
    a, b = read_results(single), read_results(tmp_path / "ray.jsonl")
    assert sorted(a) == sorted(b) == list(range(48))
    for i in a:
        assert b[i] == a[i]  # answer, correct, exact_match, reference, type, error: all fields
    sa = json.loads((tmp_path / "single.summary.json").read_text())
    sb = json.loads((tmp_path / "ray.summary.json").read_text())
    sa.pop("seconds"), sb.pop("seconds")
    assert sa == sb and sa["num_items"] == 48


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def test_processor_200_mixed_rows(ray_session, tiny_ckpt):
    from mmkit.ray import build_processor

    greedy = SamplingParams(temperature=0, max_tokens=3)
    rows = []
    for i in range(200):
        if i % 2 == 0:
            rows.append({"id": i, "prompt": f"Tell me about {i}", "image": None})
        else:
            rows.append({"id": i, "prompt": PROMPT, "image": image_bytes(i % 7, "PNG" if i % 3 else "JPEG")})
    corrupt = {11, 77, 151}
    for i in corrupt:
        rows[i]["image"] = rows[i]["image"][:40]  # truncated
    rows[40]["prompt"] = ""
    processor = build_processor(str(tiny_ckpt), greedy, concurrency=2, batch_size=16, dtype="float32")
    out = processor(ray.data.from_items(rows)).take_all()
    assert sorted(r["id"] for r in out) == list(range(200))  # every row back, once
    by_id = {r["id"]: r for r in out}
    bad = corrupt | {40}
    for i in bad:
        assert by_id[i]["error"] and by_id[i]["generated_text"] is None
    assert "image[0]" in by_id[11]["error"] and "prompt: got ''" in by_id[40]["error"]
    assert by_id[13]["image"] == rows[13]["image"] and by_id[40]["prompt"] == ""  # input columns kept
    good = [r for r in rows if r["id"] not in bad]
    inputs = [{"prompt": r["prompt"], **({"multi_modal_data": {"image": load_image_bytes(r["image"], where="x")}}
                                         if r["image"] else {})} for r in good]
    ref = get_llm(tiny_ckpt).generate(inputs, greedy, use_tqdm=False)
    for r, expected in zip(good, ref):
        got = by_id[r["id"]]
        assert got["error"] is None
        assert got["generated_tokens"] == list(expected.outputs[0].token_ids), r["id"]
        assert got["generated_text"] == expected.outputs[0].text
        assert got["num_input_tokens"] == len(expected.prompt_token_ids)


def test_processor_with_a_dict_default_equals_llm_generate(ray_session, tiny_ckpt):
    """`sampling_params` as a dict of SamplingParams fields, as ray.data.llm users pass it."""
    from mmkit.ray import build_processor

    rows = [{"id": i, "prompt": PROMPT if i % 2 else f"Tell me about {i}",
             "image": image_bytes(i) if i % 2 else None} for i in range(12)]
    processor = build_processor(str(tiny_ckpt), dict(temperature=0, max_tokens=6), concurrency=1, batch_size=6,
                                dtype="float32")
    out = {r["id"]: r for r in processor(ray.data.from_items(rows)).take_all()}
    inputs = [{"prompt": r["prompt"], **({"multi_modal_data": {"image": load_image_bytes(r["image"], where="x")}}
                                         if r["image"] else {})} for r in rows]
    ref = get_llm(tiny_ckpt).generate(inputs, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [out[i]["generated_tokens"] for i in range(12)] == [list(o.outputs[0].token_ids) for o in ref]
    assert [out[i]["generated_text"] for i in range(12)] == [o.outputs[0].text for o in ref]


def test_eval_ray_resumes_after_kill(ray_session, tiny_ckpt, tmp_path):
    (tmp_path / "img").mkdir()
    for i in range(4):
        make_image(i).save(tmp_path / "img" / f"{i}.png")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"image": f"img/{i % 4}.png", "question": f"Q{i}?", "answer": "x"}) + "\n"
                            for i in range(120)))
    results = tmp_path / "res.jsonl"
    args = ["eval", str(data), "--ray", "--ray-address", ray_session, "--output", str(results), "--model",
            str(tiny_ckpt), "--max-tokens", "12", "--batch-size", "4", "--no-progress"]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen([sys.executable, "-m", "mmkit", *args], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if results.exists() and len(results.read_bytes().splitlines()) >= 8:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = read_results(results)
    assert 0 < len(first) < 120, "kill the run part way"
    out = mmkit(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"throughput: {120 - len(first)} items in" in out.stdout  # only the remaining items ran
    lines = results.read_text().splitlines()
    indices = [json.loads(line)["index"] for line in lines]
    assert sorted(indices) == list(range(120))  # each item exactly once
    final = read_results(results)
    assert all(final[i] == first[i] for i in first)


def test_eval_ray_parquet_with_image_bytes(ray_session, tiny_ckpt, tmp_path, capsys):
    from mmkit.entrypoints.cli.main import main
    from mmkit.eval.evaluation import ResultsFile
    from mmkit.eval.ray_eval import EvalData, run_ray_evaluation

    (tmp_path / "img").mkdir()
    images, questions = [], []
    for i in range(10):
        make_image(i % 5).save(tmp_path / "img" / f"{i}.png")
        images.append((tmp_path / "img" / f"{i}.png").read_bytes())
        questions.append(f"What is in picture {i}?")
    images[7] = b"not an image at all"
    (tmp_path / "img" / "7.png").write_bytes(images[7])
    choices = [["a", "b c"] if i % 3 == 0 else None for i in range(10)]  # multiple choice (structured outputs)
    table = pa.table({"image": pa.array(images, pa.binary()), "question": questions,
                      "answer": ["a", "b"] * 5, "type": ["t1", "t2"] * 5,
                      "choices": pa.array(choices, pa.list_(pa.string()))})
    pq.write_table(table, tmp_path / "data.parquet", row_group_size=4)
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"image": f"img/{i}.png", "question": questions[i], "answer": ["a", "b"][i % 2],
                                         "type": ["t1", "t2"][i % 2], "choices": choices[i]}) + "\n"
                             for i in range(10)))
    assert main(["eval", str(jsonl), "--output", str(tmp_path / "single.jsonl"), "--model", str(tiny_ckpt),
                 "--dtype", "float32", "--max-tokens", "4", "--no-progress"]) == 0
    results = ResultsFile(tmp_path / "pq.jsonl")
    summary = run_ray_evaluation(EvalData(str(tmp_path / "data.parquet")), results, model=str(tiny_ckpt),
                                 sampling_params=SamplingParams(temperature=0, max_tokens=4, seed=None),
                                 engine_args={"dtype": "float32"}, concurrency=1, batch_size=4,
                                 show_progress=True)
    # stderr is not a terminal here: plain progress lines instead of Ray Data's bars.
    assert "Evaluating: 10/10 items (100%)" in capsys.readouterr().err
    single, ray_run = read_results(tmp_path / "single.jsonl"), read_results(tmp_path / "pq.jsonl")
    assert sorted(ray_run) == list(range(10)) and summary.num_errors == 1
    for i in range(10):
        for key in ("answer", "correct", "reference", "type", "choices"):
            assert ray_run[i].get(key) == single[i].get(key), (i, key)
    assert all(ray_run[i]["answer"] in ("a", "b c") for i in (0, 3, 6, 9))
    assert ray_run[7]["error"].startswith("item 7 (<bytes>): image[0]") and "not an image" in ray_run[7]["error"]
    # Hugging Face datasets' Image feature ({bytes, path} structs): the same rows reach the replicas.
    hf = table.set_column(0, "image", pa.array([{"bytes": b, "path": None} for b in images]))
    pq.write_table(hf, tmp_path / "hf.parquet", row_group_size=3)
    hf_data = EvalData(str(tmp_path / "hf.parquet"))
    rows = hf_data.dataset(hf_data.items[2:]).take_all()
    assert [r["index"] for r in rows] == list(range(2, 10)) and [r["image"] for r in rows] == images[2:]


def test_processor_output_columns(ray_session, tiny_ckpt):
    """`output_columns` keeps only the named columns, chosen inside the replica; a name that is
    neither an input nor a generation column is a clear error."""
    from mmkit.ray import EngineReplica, build_processor

    greedy = SamplingParams(temperature=0, max_tokens=3)
    rows = [{"id": i, "prompt": PROMPT, "image": image_bytes(i)} for i in range(4)]
    processor = build_processor(str(tiny_ckpt), greedy, batch_size=2, dtype="float32",
                                output_columns=["id", "generated_text", "error"])
    out = processor(ray.data.from_items(rows)).take_all()
    assert sorted(r["id"] for r in out) == [0, 1, 2, 3]
    assert all(set(r) == {"id", "generated_text", "error"} and r["error"] is None for r in out)
    with pytest.raises(TypeError, match="output_columns"):
        build_processor(str(tiny_ckpt), greedy, output_columns="id")
    replica = EngineReplica(str(tiny_ckpt), greedy, {"dtype": "float32"}, 1, None, {}, ("id", "answer"))
    with pytest.raises(ValueError, match=r"output_columns: \['answer'\] are neither columns of the rows "
                                         r"\['id', 'prompt', 'image'\]"):
        replica(pa.Table.from_pylist(rows[:1]))
