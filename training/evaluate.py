"""Evaluate a default-model checkpoint with transformers on held-out scenes (greedy, batched).

    OMP_WAIT_POLICY=PASSIVE python training/evaluate.py mmkit/default_model \
        --qa-scenes 100 --caption-scenes 200 --json training/eval.json

Questions: every template question of the first --qa-scenes held-out scenes (test seeds, disjoint
from training; ~6 per scene). Captions: "Describe the image." on the first --caption-scenes
held-out scenes, exact match. Also user-style drawings (one shape on white, various sizes and
positions). Answers are normalised (lower case, stripped, no trailing punctuation).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from common import scenes  # noqa: E402

from mmkit.eval.evaluation import normalize_answer  # noqa: E402  (one normalisation for training and mmkit eval)


def answer_all(model, processor, items, batch_size=32):
    """items: list of (PIL image, question) -> list of generated strings (greedy)."""
    outs = [None] * len(items)
    order = sorted(range(len(items)), key=lambda i: items[i][1])  # same question -> same length
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        texts, images = [], []
        for i in idx:
            img, q = items[i]
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}]
            texts.append(processor.apply_chat_template(msgs, add_generation_prompt=True))
            images.append(img)
        enc = processor(text=texts, images=images, padding=True, return_tensors="pt")
        long = any(items[i][1].startswith("Describe") for i in idx)
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=False, max_new_tokens=40 if long else 8,
                                 pad_token_id=processor.tokenizer.pad_token_id)
        new = gen[:, enc["input_ids"].shape[1]:]
        for j, i in enumerate(idx):
            outs[i] = processor.tokenizer.decode(new[j], skip_special_tokens=True)
    return outs


def answer_all_mmkit(model_path, items):
    """The same answers through mmkit's engine (one batched LLM.chat call, greedy)."""
    from mmkit import LLM, SamplingParams

    llm = LLM(model_path, dtype="float32")
    convs = [[{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": q}]}]
             for img, q in items]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def drawing_items():
    items = []
    specs = [("circle", "red", (200, 200), None, None), ("circle", "red", (300, 300), (80, 220), 50),
             ("circle", "red", (128, 128), (90, 40), 14), ("circle", "red", (256, 256), None, 80),
             ("square", "blue", (200, 200), (150, 60), 30), ("triangle", "green", (180, 180), None, 40),
             ("circle", (255, 0, 0), (224, 224), (60, 160), 35), ("square", "yellow", (100, 100), None, 20)]
    for shape, color, size, center, r in specs:
        img = scenes.draw_shape(shape, color, size, center, r)
        cname = color if isinstance(color, str) else "red"
        items += [(img, f"What color is the {shape}?", cname, "drawing"),
                  (img, "What shape is this?", shape, "drawing"),
                  (img, "How many shapes are there?", "one", "drawing")]
    return items


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="mmkit/default_model")
    ap.add_argument("--qa-scenes", type=int, default=100)
    ap.add_argument("--caption-scenes", type=int, default=200)
    ap.add_argument("--start", type=int, default=0, help="skip this many held-out scenes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--engine", choices=["transformers", "mmkit"], default="transformers",
                    help="generate with transformers' generate or with mmkit's engine")
    ap.add_argument("--show-errors", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    t0 = time.time()
    processor = AutoProcessor.from_pretrained(a.model)
    model = LlavaForConditionalGeneration.from_pretrained(a.model, dtype=torch.float32).eval()

    n = max(a.qa_scenes, a.caption_scenes)
    test = scenes.held_out_scenes(n, a.start)
    qa = [(sc.image, q, ans, t) for sc in test[:a.qa_scenes] for q, ans, t in sc.qa]
    cap = [(sc.image, "Describe the image.", sc.caption, "caption") for sc in test[:a.caption_scenes]]
    draw = drawing_items()
    items = qa + cap + draw
    pairs = [(im, q) for im, q, _, _ in items]
    if a.engine == "mmkit":
        preds = answer_all_mmkit(a.model, pairs)
    else:
        preds = answer_all(model, processor, pairs, a.batch_size)

    def score(lo, hi):
        per, errs = {}, []
        for (im, q, ref, t), p in zip(items[lo:hi], preds[lo:hi]):
            ok = normalize_answer(p) == normalize_answer(ref)
            c = per.setdefault(t, [0, 0])
            c[0] += ok
            c[1] += 1
            if not ok:
                errs.append({"question": q, "reference": ref, "prediction": p, "type": t})
        return per, errs

    per, errs = score(0, len(qa))
    cper, cerrs = score(len(qa), len(qa) + len(cap))
    dper, derrs = score(len(qa) + len(cap), len(items))
    total_ok = sum(v[0] for v in per.values())
    total = sum(v[1] for v in per.values())
    res = {
        "model": a.model,
        "engine": a.engine,
        "questions": total,
        "overall_accuracy": total_ok / max(1, total),
        "per_type": {t: {"accuracy": v[0] / v[1], "n": v[1]} for t, v in sorted(per.items())},
        "caption_scenes": cper.get("caption", [0, 0])[1],
        "caption_exact": cper.get("caption", [0, 1])[0] / max(1, cper.get("caption", [0, 1])[1]),
        "drawings_accuracy": dper["drawing"][0] / dper["drawing"][1],
        "drawings_n": dper["drawing"][1],
        "errors": (errs + cerrs + derrs)[:50],
        "seconds": time.time() - t0,
    }
    print(f"{'type':<12}{'n':>6}{'accuracy':>10}")
    for t, v in res["per_type"].items():
        print(f"{t:<12}{v['n']:>6}{v['accuracy']:>10.3f}")
    print(f"{'overall':<12}{total:>6}{res['overall_accuracy']:>10.3f}")
    print(f"{'captions':<12}{res['caption_scenes']:>6}{res['caption_exact']:>10.3f}  (exact, held-out scenes)")
    print(f"{'drawings':<12}{res['drawings_n']:>6}{res['drawings_accuracy']:>10.3f}  (user-style drawings)")
    for e in (errs + cerrs + derrs)[:a.show_errors]:
        print("  x", e["type"], "|", e["question"], "| ref:", e["reference"], "| got:", e["prediction"])
    print(f"({res['seconds']:.0f}s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
