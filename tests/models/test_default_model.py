"""The embedded default model: loads with LLM(), answers held-out questions, equals HF."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmkit import LLM, SamplingParams
from mmkit.eval import scenes as scene_lib
from mmkit.config import default_model_path
from mmkit.eval.evaluation import normalize_answer

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=40)
# Held-out scenes for this test start far from the ones training/evaluate.py reports on.
OFFSET = 5000


@pytest.fixture(scope="module")
def llm():
    return LLM(seed=0)


def chat(image, question):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


def test_checkpoint_is_small_and_in_llava_hf_format():
    path = default_model_path()
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 26 * 2**20


def test_held_out_accuracy(llm):
    items = []
    for scene in scene_lib.held_out_scenes(40, start=OFFSET):
        for question, answer, qtype in scene.qa:
            items.append((scene.image, question, answer, qtype))
    items = items[:110]
    outs = llm.chat([chat(img, q) for img, q, _, _ in items], GREEDY, use_tqdm=False)
    correct = [normalize_answer(o.outputs[0].text) == normalize_answer(a) for o, (_, _, a, _) in zip(outs, items)]
    accuracy = sum(correct) / len(correct)
    assert len(items) >= 100 and accuracy >= 0.93, f"held-out accuracy {accuracy:.3f}"


def test_user_drawings(llm):
    drawings = [scene_lib.draw_shape("circle", "red", (300, 200), center=(80, 120), radius=50),
                scene_lib.draw_shape("circle", "red", (64, 64)),
                scene_lib.draw_shape("circle", "red", (256, 256), center=(190, 60), radius=30)]
    outs = llm.chat([chat(d, "What color is the circle?") for d in drawings], GREEDY, use_tqdm=False)
    assert [normalize_answer(o.outputs[0].text) for o in outs] == ["red"] * 3


def test_identical_to_transformers(llm):
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = default_model_path()
    processor = AutoProcessor.from_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    for scene in scene_lib.held_out_scenes(4, start=OFFSET + 100):
        for question, _, _ in scene.qa[:3] + scene.qa[-1:]:
            prompt = processor.apply_chat_template(chat(scene.image, question), add_generation_prompt=True)
            inputs = processor(text=prompt, images=scene.image, return_tensors="pt")
            with torch.no_grad():
                ref = model.generate(**inputs, max_new_tokens=40, do_sample=False)[0, inputs["input_ids"].shape[1]:]
            out = llm.chat(chat(scene.image, question), GREEDY, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == ref.tolist()


def test_cli_ask_red_circle(tmp_path):
    path = tmp_path / "red_circle.png"
    scene_lib.draw_shape("circle", "red", (200, 160), center=(70, 90), radius=40).save(path)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([sys.executable, "-m", "mmkit", "ask", str(path), "What color is the circle?"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert normalize_answer(out.stdout) == "red"


def test_readme_caption_command_runs():
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([sys.executable, "-m", "mmkit", "caption", "assets/scenes/red_circle.png"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "red circle" in out.stdout
