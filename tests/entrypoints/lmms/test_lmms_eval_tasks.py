"""The shipped lmms-eval tasks (assets/eval/lmms_tasks) through the `lmms-eval` command,
offline, with the embedded default model: `--model mmkit` gives `mmkit eval`'s per-item answers
and score, and so does `--model openai` against `mmkit serve`; the multiple-choice task scores
as the free answers do. lmms-eval exits 0 even when an evaluation fails: the results files
are what is judged."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmkit.entrypoints.cli.main import main as mmkit_main
from serve_utils import ServerProcess

pytest.importorskip("lmms_eval", reason="needs the lmms-eval extra: pip install -e '.[lmms-eval]'")

REPO = Path(__file__).resolve().parents[3]
TASKS = REPO / "assets" / "eval" / "lmms_tasks"
DATA = REPO / "assets" / "eval" / "quickstart.jsonl"


def _lmms_eval(out: Path, model: str, model_args: str, tasks: str, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "lmms_eval", "--model", model, "--model_args", model_args, "--tasks", tasks,
           "--include_path", str(TASKS), "--output_path", str(out), "--log_samples", "--batch_size", "8"]
    full_env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=REPO, timeout=600)
    results = sorted(out.rglob("*_results.json"))
    assert proc.returncode == 0 and results, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = {}
    for task in tasks.split(","):
        path, = out.rglob(f"*_samples_{task}.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.open()), key=lambda s: s["doc_id"])
    return {"results": json.loads(results[-1].read_text())["results"], "samples": samples}


@pytest.fixture(scope="module")
def mmkit_run(tmp_path_factory):
    return _lmms_eval(tmp_path_factory.mktemp("lmms_mmkit"), "mmkit", "dtype=float32,threads=2",
                      "mmkit_scenes_qa,mmkit_scenes_mc")


@pytest.fixture(scope="module")
def mmkit_eval_records(tmp_path_factory):
    out = tmp_path_factory.mktemp("mmkit_eval") / "results.jsonl"
    assert mmkit_main(["eval", str(DATA), "--output", str(out), "--no-progress", "--dtype", "float32",
                       "--threads", "2"]) == 0
    records = sorted((json.loads(line) for line in out.open()), key=lambda r: r["index"])
    summary = json.loads(out.with_name("results.summary.json").read_text())
    return records, summary


def _answers(samples) -> list[str]:
    return [(s["filtered_resps"] if isinstance(s["filtered_resps"], str) else s["filtered_resps"][0]).strip()
            for s in samples]


def test_generation_task_equals_mmkit_eval(mmkit_run, mmkit_eval_records):
    records, summary = mmkit_eval_records
    samples = mmkit_run["samples"]["mmkit_scenes_qa"]
    assert len(samples) == len(records) == 48
    assert _answers(samples) == [r["answer"] for r in records]
    assert mmkit_run["results"]["mmkit_scenes_qa"]["accuracy,none"] == pytest.approx(summary["accuracy"])


def test_multiple_choice_scores_as_free_answers(mmkit_run, mmkit_eval_records):
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("scene_task_utils", TASKS / "utils.py")
    utils = module_from_spec(spec)
    spec.loader.exec_module(utils)
    records, _ = mmkit_eval_records
    free = [r for r in records if r["type"] in utils.OPTIONS]
    samples = mmkit_run["samples"]["mmkit_scenes_mc"]
    assert len(samples) == len(free) > 0
    for sample, rec in zip(samples, free):
        choices = utils.OPTIONS[rec["type"]]
        nlls = [float(pair[0]) for pair in sample["filtered_resps"]]  # the samples file holds strings
        assert choices[nlls.index(min(nlls))] == rec["answer"], (rec, nlls)  # the lowest -sum log p
    free_acc = sum(r["correct"] for r in free) / len(free)
    assert mmkit_run["results"]["mmkit_scenes_mc"]["acc,none"] == pytest.approx(free_acc)


@pytest.mark.slow  # a second lmms-eval run and a server: ~1.5 min on the shared 2-core machine
def test_openai_model_against_mmkit_serve_agrees(mmkit_run, tmp_path):
    server = ServerProcess("--dtype", "float32", "--served-model-name", "mmkit")
    try:
        run = _lmms_eval(tmp_path, "openai", f"model_version=mmkit,base_url={server.base_url},num_concurrent=4",
                         "mmkit_scenes_qa", env={"OPENAI_API_KEY": "unused"})
    finally:
        server.stop()
    assert _answers(run["samples"]["mmkit_scenes_qa"]) == _answers(mmkit_run["samples"]["mmkit_scenes_qa"])
    assert run["results"]["mmkit_scenes_qa"]["accuracy,none"] == mmkit_run["results"]["mmkit_scenes_qa"]["accuracy,none"]
