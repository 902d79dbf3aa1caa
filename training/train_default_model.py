"""Train mmkit's embedded default model (a tiny LLaVA) on procedural shape scenes, on CPU.

    OMP_WAIT_POLICY=PASSIVE python training/train_default_model.py --threads 2 \
        --steps-a 3000 --steps-b 6000 --steps-c 6000 --export mmkit/default_model

Three stages (a tiny vision tower learns too slowly from the language-model loss alone):
  a. the CLIP vision tower alone, with dense heads on every patch (shape / colour / size / rank
     from the left of the object under it) and a count head;
  b. projector + Llama decoder on the template questions, the tower frozen; the projector's first
     layer is initialised to standardise the tower's features, its output scaled to the text
     embeddings' scale;
  c. everything together at a lower learning rate.
Resumable: every --save-every seconds (and at the end of each stage) the model, heads, optimizer
and stage/step go to --state (training/state/); rerunning the same command continues from there.
Deterministic in --seed for a given schedule (data: scene seeds streamed in order into a pool).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import (GRID, ROOT, TextCache, build_processor, lm_batch, make_config,  # noqa: E402
                    normalize, patch_labels, scenes, square_uint8)

QTYPE_WEIGHTS = {  # per stage: c leans on the questions that look an object up by its shape
    "b": {"caption": 3.0, "color": 1.5, "size_color": 1.5, "left_shape": 1.5,
          "exists": 1.0, "count": 1.0, "shape": 1.0},
    "c": {"caption": 3.0, "color": 2.5, "size_color": 1.0, "left_shape": 1.5,
          "exists": 3.0, "count": 0.7, "shape": 0.7},
}
STAGES = ("a", "b", "c")


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


class Pool:
    """A ring of pre-rendered training scenes; each step streams `refresh` new seeds into it."""

    def __init__(self, size: int, refresh: int, start_seed: int, consumed: int):
        self.size, self.refresh, self.start = size, refresh, start_seed
        self.next_seed = start_seed + max(consumed, size)
        first = self.next_seed - size
        self.pix = torch.zeros((size, 3, 128, 128), dtype=torch.uint8)
        self.lab = torch.zeros((size, GRID * GRID, 4), dtype=torch.long)
        self.count = torch.zeros(size, dtype=torch.long)
        self.meta = [None] * size
        for s in range(first, self.next_seed):
            self._put(s)

    def _put(self, seed):
        sc = scenes.make_scene(seed)
        i = seed % self.size
        self.pix[i] = square_uint8(sc.image)
        self.lab[i] = torch.from_numpy(patch_labels(sc))
        self.count[i] = len(sc.shapes) - 1
        self.meta[i] = sc.qa

    def step(self):
        for _ in range(self.refresh):
            self._put(self.next_seed)
            self.next_seed += 1

    @property
    def consumed(self):
        return self.next_seed - self.start


class Heads(nn.Module):
    """Stage-a supervision on the features the projector sees (hidden_states[-1], patches)."""

    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.patch = nn.Linear(d, 4 + 7 + 3 + 4)
        self.count = nn.Linear(d, 3)

    def forward(self, feats, labels, count):
        h = self.norm(feats[:, 1:].float())
        out = self.patch(h)
        splits = out.split([4, 7, 3, 4], dim=-1)
        loss, accs = 0.0, []
        for k, logits in enumerate(splits):
            y = labels[..., k]
            w = torch.where(y > 0, 1.0, 0.3)
            l = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
            loss = loss + (l * w.reshape(-1)).sum() / w.sum()
            fg = y > 0
            accs.append(((logits.argmax(-1) == y) & fg).sum().item() / max(1, fg.sum().item()))
        c = self.count(self.norm(feats[:, 1:].float()).mean(1))
        loss = loss + F.cross_entropy(c, count)
        accs.append((c.argmax(-1) == count).float().mean().item())
        return loss, accs


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def sample_qa(rng, qa, weights):
    by = {}
    for q, a, t in qa:
        by.setdefault(t, []).append((q, a))
    types = sorted(by)
    t = rng.choices(types, weights=[weights.get(x, 1.0) for x in types])[0]
    return rng.choice(by[t])


@torch.no_grad()
def init_projector(model, pool, text_std):
    """Fold the tower features' per-channel standardisation into linear_1; scale linear_2 output."""
    idx = torch.arange(min(256, pool.size))
    pv = normalize(pool.pix[idx])
    feats = model.model.vision_tower(pv, output_hidden_states=True).hidden_states[-1][:, 1:]
    feats = feats.reshape(-1, feats.shape[-1]).float()
    mean, std = feats.mean(0), feats.std(0) + 1e-5
    proj = model.model.multi_modal_projector
    d_in = proj.linear_1.in_features
    nn.init.normal_(proj.linear_1.weight, std=1.0 / math.sqrt(d_in))
    proj.linear_1.weight.div_(std[None, :])
    proj.linear_1.bias.copy_(-(proj.linear_1.weight @ mean))
    nn.init.normal_(proj.linear_2.weight, std=1.0 / math.sqrt(proj.linear_2.in_features))
    proj.linear_2.bias.zero_()
    out = proj(feats[:4096])
    proj.linear_2.weight.mul_(text_std / out.std())
    log(f"projector init: tower feature std {feats.std().item():.3f}, "
        f"projected std {proj(feats[:4096]).std().item():.4f}, text embedding std {text_std:.4f}")


def save_state(args, model, heads, opt, st, processor):
    tmp = args.state + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(os.path.join(tmp, "model"))
    processor.save_pretrained(os.path.join(tmp, "model"))
    torch.save(heads.state_dict(), os.path.join(tmp, "heads.pt"))
    if opt is not None:  # optional on resume (not committed: see training/.gitignore)
        torch.save(opt.state_dict(), os.path.join(tmp, "optimizer.pt"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump(st, f, indent=1)
    old = args.state + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(args.state):
        os.rename(args.state, old)
    os.rename(tmp, args.state)
    shutil.rmtree(old, ignore_errors=True)
    log(f"saved state: stage {st['stage']} step {st['step']}")


def export(model, processor, out):
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    log("exported to", out)


def make_optimizer(model, heads, stage, args):
    if stage == "a":
        params = list(model.model.vision_tower.parameters()) + list(heads.parameters())
    elif stage == "b":
        params = (list(model.model.multi_modal_projector.parameters())
                  + list(model.model.language_model.parameters()) + list(model.lm_head.parameters()))
    else:
        params = list(model.parameters()) + (list(heads.parameters()) if args.aux_c > 0 else [])
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    decay = [p for p in params if p.ndim >= 2]
    nodecay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                              {"params": nodecay, "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.98), eps=1e-8)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", default=os.path.join(ROOT, "training", "state"))
    ap.add_argument("--export", default=None, help="write the final checkpoint here (e.g. mmkit/default_model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps-a", type=int, default=3000)
    ap.add_argument("--steps-b", type=int, default=6000)
    ap.add_argument("--steps-c", type=int, default=6000)
    ap.add_argument("--batch-a", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr-a", type=float, default=2e-3)
    ap.add_argument("--lr-b", type=float, default=1e-3)
    ap.add_argument("--lr-c", type=float, default=5e-4)
    ap.add_argument("--aux-c", type=float, default=1.0, help="weight of the stage-a heads' loss in stage c")
    ap.add_argument("--pool", type=int, default=8000)
    ap.add_argument("--refresh", type=int, default=8, help="new scenes streamed into the pool per step")
    ap.add_argument("--save-every", type=float, default=300.0, help="seconds between resume checkpoints")
    ap.add_argument("--time-budget", type=float, default=0.0, help="minutes; save and stop after this (0: none)")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from transformers import LlavaForConditionalGeneration
    t_start = time.time()
    processor = build_processor()
    tok = processor.tokenizer
    cache = TextCache(tok)
    steps = {"a": args.steps_a, "b": args.steps_b, "c": args.steps_c}

    st = {"stage": "a", "step": 0, "consumed": 0}
    resume = os.path.exists(os.path.join(args.state, "state.json"))
    if resume:
        with open(os.path.join(args.state, "state.json")) as f:
            st = json.load(f)
        model = LlavaForConditionalGeneration.from_pretrained(os.path.join(args.state, "model"),
                                                              dtype=torch.float32)
        log(f"resuming stage {st['stage']} step {st['step']}")
    else:
        torch.manual_seed(args.seed)
        cfg = make_config(len(tok), tok.convert_tokens_to_ids("<image>"))
        model = LlavaForConditionalGeneration(cfg)
        with torch.no_grad():  # text embeddings on an O(1) scale (the projector is scaled to match)
            model.model.language_model.embed_tokens.weight.normal_(0.0, 1.0)
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 3
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"params {n_params/1e6:.2f}M")
    heads = Heads(model.config.vision_config.hidden_size)
    saved = None
    if resume:
        saved = {"heads": None, "opt": None}
        tp = os.path.join(args.state, "train.pt")  # older single-file layout
        if os.path.exists(tp):
            saved.update(torch.load(tp, weights_only=False))
        for key, name in (("heads", "heads.pt"), ("opt", "optimizer.pt")):
            if os.path.exists(os.path.join(args.state, name)):
                saved[key] = torch.load(os.path.join(args.state, name), weights_only=False)
        if saved["heads"] is not None:
            heads.load_state_dict(saved["heads"])

    pool = Pool(args.pool, args.refresh, 0, st["consumed"])
    log(f"pool ready ({args.pool} scenes) in {time.time()-t_start:.0f}s")
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if not args.fp32 else (lambda: torch.autocast("cpu", enabled=False))
    last_save = time.time()

    for stage in STAGES:
        if STAGES.index(stage) < STAGES.index(st["stage"]):
            continue
        if st["stage"] != stage:
            st = {"stage": stage, "step": 0, "consumed": pool.consumed}
        opt = make_optimizer(model, heads, stage, args)
        if saved is not None and saved.get("opt") is not None and st["step"] > 0:
            try:
                opt.load_state_dict(saved["opt"])
            except Exception as e:  # noqa: BLE001
                log("optimizer state not restored:", e)
        saved = None
        if stage == "b" and st["step"] == 0:
            text_std = model.model.language_model.embed_tokens.weight.std().item()
            init_projector(model, pool, text_std)
        peak = {"a": args.lr_a, "b": args.lr_b, "c": args.lr_c}[stage]
        total = steps[stage]
        warm = max(1, min(300, total // 10))
        t0, run_loss, run_acc, n_log, run_lm = time.time(), 0.0, None, 0, 0.0
        while st["step"] < total:
            step = st["step"]
            rng = random.Random(args.seed * 1_000_003 + STAGES.index(stage) * 10_000_019 + step)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, peak, warm)
            if stage == "a":
                idx = torch.tensor([rng.randrange(pool.size) for _ in range(args.batch_a)])
                with ctx():
                    feats = model.model.vision_tower(normalize(pool.pix[idx]),
                                                     output_hidden_states=True).hidden_states[-1]
                loss, accs = heads(feats, pool.lab[idx], pool.count[idx])
            else:
                idx = [rng.randrange(pool.size) for _ in range(args.batch)]
                items = [sample_qa(rng, pool.meta[i], QTYPE_WEIGHTS[stage]) for i in idx]
                ids, mask, labels = lm_batch(cache, items)
                with ctx():
                    out = model(input_ids=ids, attention_mask=mask,
                                pixel_values=normalize(pool.pix[torch.tensor(idx)]), labels=labels)
                loss, accs = out.loss, None
                if stage == "c" and args.aux_c > 0:  # keep the dense vision supervision going
                    it = torch.tensor(idx)
                    with ctx():
                        feats = model.model.vision_tower(normalize(pool.pix[it]),
                                                         output_hidden_states=True).hidden_states[-1]
                    aux, accs = heads(feats, pool.lab[it], pool.count[it])
                    run_lm += loss.item()
                    loss = loss + args.aux_c * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
            opt.step()
            pool.step()
            st["step"] = step + 1
            st["consumed"] = pool.consumed
            run_loss += loss.item()
            if accs is not None:
                run_acc = accs if run_acc is None else [x + y for x, y in zip(run_acc, accs)]
            n_log += 1
            if st["step"] % 100 == 0 or st["step"] == total:
                msg = f"stage {stage} step {st['step']}/{total} loss {run_loss/n_log:.4f} lr {opt.param_groups[0]['lr']:.2e}"
                if run_lm:
                    msg += f" lm {run_lm/n_log:.4f}"
                if run_acc is not None:
                    msg += " acc(shape,colour,size,rank,count) " + ",".join(f"{x/n_log:.3f}" for x in run_acc)
                msg += f" {n_log/(time.time()-t0):.2f} steps/s"
                log(msg)
                t0, run_loss, run_acc, n_log, run_lm = time.time(), 0.0, None, 0, 0.0
            over = args.time_budget and (time.time() - t_start) > args.time_budget * 60
            if time.time() - last_save > args.save_every or st["step"] == total or over:
                if st["step"] == total and stage != "c":
                    nxt = {"stage": STAGES[STAGES.index(stage) + 1], "step": 0, "consumed": pool.consumed}
                    save_state(args, model, heads, None, nxt, processor)
                else:
                    save_state(args, model, heads, opt, st, processor)
                last_save = time.time()
            if over:
                log("time budget reached; rerun the same command to continue")
                return
    model.eval()
    if args.export:
        export(model, processor, args.export)
    log("done")


if __name__ == "__main__":
    main()
