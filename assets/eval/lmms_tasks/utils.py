"""Helpers of the mmkit scene tasks (lmms-eval loads this file for `!function utils.X`).

The documents are `assets/eval/quickstart.jsonl`'s rows; image paths are relative to that file.
"""

from pathlib import Path

from PIL import Image

_DATA_DIR = Path(__file__).resolve().parent.parent
# The options of each question type (the scene generator's vocabulary, `mmkit.eval.scenes`).
OPTIONS = {
    "color": ["red", "green", "blue", "yellow", "purple", "orange"],
    "size_color": ["red", "green", "blue", "yellow", "purple", "orange"],
    "count": ["zero", "one", "two", "three"],
    "exists": ["yes", "no"],
    "left_shape": ["circle", "square", "triangle"],
    "shape": ["circle", "square", "triangle"],
}


def doc_to_visual(doc):
    return [Image.open(_DATA_DIR / doc["image"]).convert("RGB")]


def doc_to_text(doc):
    return doc["question"]


def doc_to_target(doc):
    return doc["answer"]


def process_results(doc, results):
    """mmkit eval's normalised accuracy: lower case, no surrounding space or trailing punctuation."""
    from mmkit.eval.evaluation import is_correct

    return {"accuracy": float(is_correct(results[0], [doc["answer"]]))}


def mc_process_docs(dataset):
    return dataset.filter(lambda doc: doc["type"] in OPTIONS)


def mc_doc_to_choice(doc):
    return OPTIONS[doc["type"]]
