"""`mmkit eval` with a `choices` column, and the embedded default model on a multiple-choice
version of its held-out questions: constrained is at least as accurate as free answers."""

import json

import pytest

from conftest import make_image
from mmkit import LLM, SamplingParams
from mmkit.eval import scenes as scene_lib
from mmkit.entrypoints.cli.main import main as mmkit_main, question_inputs
from mmkit.eval.evaluation import ResultsFile, read_dataset, run_evaluation
from mmkit.multimodal.image_io import load_image

# The qtypes of the held-out questions and their options (captions are free text: left out).
OPTIONS = {"color": scene_lib.COLORS, "size_color": scene_lib.COLORS, "count": scene_lib.NUMBER_WORDS,
           "exists": ("yes", "no"), "left_shape": scene_lib.SHAPES, "shape": scene_lib.SHAPES}
OFFSET = 7000  # held-out scenes away from those test_default_model.py and training report on


def test_eval_choices_column_tiny(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "img").mkdir()
    make_image(0).save(tmp_path / "img" / "0.png")
    rows = [{"image": "img/0.png", "question": f"Question {i}?", "answer": "yes" if i % 2 else "No",
             "choices": ["yes", "No"], "type": "yn"} for i in range(6)]
    rows.append({"image": "img/0.png", "question": "Free?", "answer": "z", "type": "free"})
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = tmp_path / "out.jsonl"
    assert mmkit_main(["eval", str(data), "--output", str(results), "--model", str(tiny_ckpt), "--max-tokens", "1",
                       "--no-progress"]) == 0
    records = [json.loads(line) for line in results.read_text().splitlines()]
    mc = [r for r in records if r["type"] == "yn"]
    assert all(r["answer"] in ("yes", "No") and r["choices"] == ["yes", "No"] for r in mc)
    assert all(r["correct"] == (r["answer"] == r["reference"][0]) for r in mc)  # exact match, case kept
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert set(summary["per_type"]) == {"yn", "free"}
    assert "question type" in capsys.readouterr().out


@pytest.mark.parametrize("cell, expected", [('["a", "b c"]', ["a", "b c"]), ("a| b c", ["a", "b c"])])
def test_csv_choices(tmp_path, cell, expected):
    path = tmp_path / "d.csv"
    path.write_text(f"image,question,choices\nx.png,Q?,\"{cell.replace(chr(34), chr(34) * 2)}\"\n")
    assert read_dataset(path)[0].choices == expected


@pytest.mark.parametrize("value", [[], ["a", ""], "[1, 2]", [3]])
def test_bad_choices_name_the_item(tmp_path, value):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"image": "x.png", "question": "Q?", "choices": value}) + "\n")
    with pytest.raises(ValueError, match=r"DATA: d.jsonl item 0: choices: got"):
        read_dataset(path)


def test_default_model_multiple_choice_at_least_as_accurate(tmp_path):
    rows = []
    (tmp_path / "img").mkdir()
    for k, scene in enumerate(scene_lib.held_out_scenes(30, start=OFFSET)):
        scene.image.save(tmp_path / "img" / f"{k}.png")
        for question, answer, qtype in scene.qa:
            if qtype in OPTIONS:
                rows.append({"image": f"img/{k}.png", "question": question, "answer": answer, "type": qtype,
                             "choices": list(OPTIONS[qtype])})
    rows = rows[:120]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    free_data = tmp_path / "free.jsonl"
    free_data.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "choices"}) + "\n" for r in rows))

    llm = LLM(seed=0)

    def build(item):
        return question_inputs(llm, load_image(item.image_path, where=item.image), item.question)

    greedy = SamplingParams(temperature=0, max_tokens=40)
    constrained = run_evaluation(llm, read_dataset(data), ResultsFile(tmp_path / "mc_out.jsonl"), build, greedy,
                                 show_progress=False)
    free = run_evaluation(llm, read_dataset(free_data), ResultsFile(tmp_path / "free_out.jsonl"), build, greedy,
                          show_progress=False)
    print(f"default model, {len(rows)} held-out multiple-choice questions: constrained accuracy "
          f"{constrained.accuracy:.3f} (exact match), unconstrained {free.accuracy:.3f} (normalised)")
    assert constrained.num_scored == free.num_scored == len(rows) >= 100
    assert constrained.accuracy >= free.accuracy
    # Where the free answer is already one of the options, the constrained one is the same.
    mc = ResultsFile(tmp_path / "mc_out.jsonl").records
    for i, rec in ResultsFile(tmp_path / "free_out.jsonl").records.items():
        if rec["answer"] in rows[i]["choices"]:
            assert mc[i]["answer"] == rec["answer"]
