"""Regenerates the notebooks and runs them, so they are stored with their outputs (captions,
images, the chart) and read well on GitHub without a kernel:

    python notebooks/make_notebooks.py [NAME ...]     # needs the test or notebooks extra

tests/test_notebooks.py runs each notebook again and compares its outputs with the stored
ones (`normalized_outputs`: text and structure, not timings or image bytes), so a change to
mmkit that changes what a notebook shows fails there until this script is rerun.
"""
from __future__ import annotations

import base64
import copy
import io
import os
import re
import sys
from pathlib import Path

import nbformat as nbf

HERE = Path(__file__).parent
# Stored images stay small: at most this wide (pixels), re-encoded as palette PNGs.
MAX_IMAGE_WIDTH = 480

def nb(cells):
    n = nbf.v4.new_notebook()
    n.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    # A cell starting with "md:" is markdown; every other cell is code.
    n.cells = [nbf.v4.new_markdown_cell(c[3:]) if c.startswith("md:") else nbf.v4.new_code_cell(c) for c in cells]
    return n

SETUP = '''import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: avoids slow OpenMP spinning on small CPUs
import torch
torch.set_num_threads(min(4, os.cpu_count() or 1))

from pathlib import Path
ASSETS = Path("..") / "assets" if Path("../assets").exists() else Path("assets")'''

cap = nb([
"md:# Image captioning with mmkit\n\nCaption pictures with the embedded default model (a small LLaVA trained on synthetic shape scenes). `LLM()` with no `model` loads it from `mmkit/default_model`; pass `model=\"path/to/llava-checkpoint\"` for any llava-hf checkpoint.",
SETUP,
'''from mmkit import LLM, SamplingParams, MultiModalData
from PIL import Image

llm = LLM(seed=0)  # the embedded default model
greedy = SamplingParams(temperature=0, max_tokens=48)''',
"md:## One image, through the chat template\n`LLM.chat` takes OpenAI-style messages; images may be PIL images, local paths, `file://` URLs or `data:` URIs.",
'''image = Image.open(ASSETS / "scenes" / "scene_0.png")
out = llm.chat([{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "Describe the image."}]}], greedy, use_tqdm=False)
print(out[0].outputs[0].text.strip())
image''',
"md:## A batch of images in one call\nEvery prompt carries its own image; the engine decodes them together and returns outputs in input order.",
'''paths = sorted((ASSETS / "scenes").glob("scene_*.png"))
messages = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(p)}},
                                          {"type": "text", "text": "Describe the image."}]}] for p in paths]
for path, result in zip(paths, llm.chat(messages, greedy, use_tqdm=False)):
    print(f"{path.name}: {result.outputs[0].text.strip()}")

# The same images side by side, each scaled to 96 px, scene_0 first.
strip = Image.new("RGB", (100 * len(paths), 96), "white")
for i, path in enumerate(paths):
    strip.paste(Image.open(path).convert("RGB").resize((96, 96)), (100 * i, 0))
strip''',
"md:## Raw pixel tensors\n`MultiModalData` also takes NCHW tensors of raw pixels: uint8 in 0-255 or float in 0-1 (the same picture gives the same caption).",
'''import numpy as np
pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)[None]  # [1, 3, H, W] uint8
prompt = out[0].prompt  # the prompt the chat template rendered above, with its <image> placeholder
as_uint8 = llm.generate({"prompt": prompt, "multi_modal_data": MultiModalData(type=MultiModalData.Type.IMAGE, data=pixels)}, greedy, use_tqdm=False)
as_float = llm.generate({"prompt": prompt, "multi_modal_data": MultiModalData(type=MultiModalData.Type.IMAGE, data=pixels.float() / 255)}, greedy, use_tqdm=False)
print(as_uint8[0].outputs[0].text.strip())
assert as_uint8[0].outputs[0].token_ids == as_float[0].outputs[0].token_ids''',
])

vqa = nb([
"md:# Visual question answering\n\nAsk questions about images, one at a time or many at once. The default model answers questions about colours, counts, shapes and positions in its synthetic scenes.",
SETUP,
'''import json
from mmkit import LLM, SamplingParams
from PIL import Image

llm = LLM(seed=0)
greedy = SamplingParams(temperature=0, max_tokens=16)

def ask(image, question):
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
    return llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0].text.strip()''',
'''image = Image.open(ASSETS / "scenes" / "red_circle.png")
for q in ["What color is the circle?", "How many shapes are there?", "Is there a triangle?"]:
    print(q, "->", ask(image, q))
image''',
"md:## Many questions in one batched call\nThe same image asked ten times is encoded once (the vision-embedding cache) and the shared prompt prefix is computed once (prefix caching).",
'''scenes = json.loads((ASSETS / "scenes" / "scenes.json").read_text())
batch, truth = [], []
for name, info in scenes.items():
    img = Image.open(ASSETS / "scenes" / name)
    for question, answer, qtype in info["qa"]:
        batch.append([{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": question}]}])
        truth.append((name, question, answer))
outs = llm.chat(batch, greedy, use_tqdm=False)
correct = 0
for (name, question, answer), out in zip(truth, outs):
    got = out.outputs[0].text.strip().lower().rstrip(".")
    correct += got == answer
    print(f"{name:12s} {question:32s} {got:40s} {'ok' if got == answer else 'expected ' + answer}")
print(f"accuracy: {correct}/{len(truth)}")
print(llm.get_metrics())''',
])

ev = nb([
"md:# Batch evaluation\n\nEvaluate a dataset of image + question (+ reference answers) in one batched run, from Python and from the command line, and chart accuracy per question type. The data format is JSONL or CSV with the columns `image` (path relative to the data file), `question`, optional `answer` (a string, or in JSONL a list of accepted strings) and optional `type`.",
SETUP,
'''import tempfile
from mmkit import LLM, SamplingParams
from mmkit.entrypoints.cli.main import question_inputs
from mmkit.eval.evaluation import ResultsFile, format_summary, read_dataset, run_evaluation
from mmkit.multimodal.image_io import load_image

data = ASSETS / "eval" / "quickstart.jsonl"
items = read_dataset(data)
print(len(items), "items; first:", items[0])''',
'''llm = LLM(seed=0)
results_path = Path(tempfile.mkdtemp()) / "results.jsonl"
results = ResultsFile(results_path)

def build(item):
    return question_inputs(llm, load_image(item.image_path, where=f"item {item.index}"), item.question)

summary = run_evaluation(llm, items, results, build, SamplingParams(temperature=0, max_tokens=32), show_progress=False)
print(format_summary(summary))''',
"md:The same run from the command line (resumable: rerunning skips finished items):\n\n    mmkit eval assets/eval/quickstart.jsonl --output results.jsonl",
'''%matplotlib inline
from mmkit.eval.chart import accuracy_chart

fig = accuracy_chart(summary)  # one bar per question type; fig.savefig("accuracy.png") keeps it''',
'''import json
wrong = [json.loads(line) for line in results_path.read_text().splitlines()]
wrong = [r for r in wrong if r["correct"] is False]
print(f"{len(wrong)} wrong answers")
for r in wrong[:10]:
    print(r["image"], r["question"], "->", r["answer"], "(expected", r["reference"], ")")''',
])
NOTEBOOKS = {"captioning": cap, "vqa": vqa, "batch_evaluation": ev}


def execute(notebook: nbf.NotebookNode, timeout: int = 300) -> nbf.NotebookNode:
    """Run a copy of `notebook` top to bottom in a fresh kernel started in this folder, as
    Jupyter would (matplotlib's inline backend, whatever MPLBACKEND says)."""
    from nbclient import NotebookClient

    notebook = copy.deepcopy(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    saved = os.environ.pop("MPLBACKEND", None)
    try:
        NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(HERE)}}).execute()
    finally:
        if saved is not None:
            os.environ["MPLBACKEND"] = saved
    return notebook


def finalize(notebook: nbf.NotebookNode) -> nbf.NotebookNode:
    """What is stored: images shrunk, no metadata that changes from run to run or host to host."""
    notebook.metadata.pop("widgets", None)
    notebook.metadata["language_info"] = {"name": "python"}
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                data.pop("image/jpeg", None)  # PIL offers both; one copy is enough
                data["image/png"] = shrink_png(data["image/png"])
    return notebook


def shrink_png(b64: str) -> str:
    """A base64 PNG at most MAX_IMAGE_WIDTH wide, as a 64-colour palette PNG (a few KB)."""
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")
    if image.width > MAX_IMAGE_WIDTH:
        height = round(image.height * MAX_IMAGE_WIDTH / image.width)
        image = image.resize((MAX_IMAGE_WIDTH, height), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.quantize(64).save(buffer, format="PNG", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_DURATION = re.compile(r"\b\d+(\.\d+)? ?(s|ms|seconds)\b")


def normalized_outputs(notebook: nbf.NotebookNode) -> list[list[tuple]]:
    """Per code cell, its outputs' kinds and texts: what must stay current. Image bytes,
    object addresses and durations vary from run to run and are left out."""

    def text(value) -> str:
        value = "".join(value) if isinstance(value, list) else str(value)
        return _DURATION.sub("<duration>", _ADDRESS.sub("", value)).strip()

    cells = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        outputs: list[tuple] = []
        for output in cell.outputs:
            kind = output.output_type
            if kind == "stream":
                # NOTE: the kernel splits a stream where it flushed; joined, the text is what counts.
                if outputs and outputs[-1][:2] == (kind, output.name):
                    outputs[-1] = (kind, output.name, outputs[-1][2] + output.text)
                else:
                    outputs.append((kind, output.name, output.text))
            elif kind in ("display_data", "execute_result"):
                data = output.get("data", {})
                mimes = sorted({"image" if mime.startswith("image/") else mime for mime in data})
                outputs.append((kind, tuple(mimes), data.get("text/plain", "")))
            elif kind == "error":
                outputs.append((kind, output.ename, output.evalue))
        cells.append([(a, b, text(c)) for a, b, c in outputs])
    return cells


if __name__ == "__main__":
    for name in sys.argv[1:] or list(NOTEBOOKS):
        path = HERE / f"{name}.ipynb"
        print(f"running {path.name} ...", flush=True)
        nbf.write(finalize(execute(NOTEBOOKS[name])), path)
