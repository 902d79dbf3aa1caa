"""Shared pieces of the side-by-side benchmarks: seeded workloads, both systems, timing helpers.

Every script imports this module first: it sets OpenMP's environment before torch loads, the
same defaults `import mmkit` and the `mmkit` command set (OMP_WAIT_POLICY=PASSIVE,
GOMP_SPINCOUNT=20000); both systems run in the same process, so under the same settings.
"""

from __future__ import annotations

import os
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

NUM_SPECIAL_TOKENS = 5  # <unk> <s> </s> <pad> <image> (mmkit/testing.py)
BOS_ID, IMAGE_ID = 1, 4


@dataclass
class Request:
    text_ids: list[int]  # prompt text tokens after <s> <image>
    image_seed: int
    max_tokens: int


WORKLOADS = ("mixed", "uniform", "decode-heavy")
# Image size of the benchmark LLaVA's CLIP tower per workload (patch 16): 224 px = 196 image
# tokens; decode-heavy's small images, 96 px = 36 image tokens.
WORKLOAD_IMAGE_SIZE = {"mixed": 224, "uniform": 224, "decode-heavy": 96}


def make_workload(kind: str, num_requests: int, seed: int = 0, vocab_size: int = 49152,
                  min_prompt: int = 16, max_prompt: int = 64, min_out: int = 8, max_out: int = 128,
                  uniform_len: int = 64) -> list[Request]:
    """`mixed`: output lengths uniform in [min_out, max_out]; `uniform`: all `uniform_len`;
    `decode-heavy`: ~30-token prompts (24..40) and mixed outputs (a user's short questions on
    small images, run on the 96 px checkpoint)."""
    if kind not in WORKLOADS:
        raise ValueError(f"workload: got {kind!r}; expected one of {WORKLOADS}")
    if kind == "decode-heavy":
        min_prompt, max_prompt = 24, 40
    rng = random.Random(seed)
    reqs = []
    for i in range(num_requests):
        n = rng.randint(min_prompt, max_prompt)
        text = [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(n)]
        out = uniform_len if kind == "uniform" else rng.randint(min_out, max_out)
        reqs.append(Request(text, seed * 100_003 + i, out))
    return reqs


# `--large-images`: every request's image is a 1024x768 photo (assets/photos, upscaled once,
# then a seed-dependent 1024x768 crop: distinct content per request, so no cache hits).
LARGE_IMAGES = False
LARGE_SIZE = (1024, 768)
_PHOTOS: list = []


def _large_photo(seed: int):
    from PIL import Image

    if not _PHOTOS:
        folder = Path(__file__).resolve().parent.parent / "assets" / "photos"
        for path in sorted(folder.glob("*.jpg")):
            with Image.open(path) as img:
                _PHOTOS.append(img.convert("RGB").resize((LARGE_SIZE[0] + 64, LARGE_SIZE[1] + 48),
                                                         Image.Resampling.BICUBIC))
    photo = _PHOTOS[seed % len(_PHOTOS)]
    dx, dy = (seed // len(_PHOTOS)) % 64, (seed // (len(_PHOTOS) * 64)) % 48
    return photo.crop((dx, dy, dx + LARGE_SIZE[0], dy + LARGE_SIZE[1]))


def make_image(seed: int, size: int):
    import numpy as np
    from PIL import Image

    if LARGE_IMAGES:
        return _large_photo(seed)
    rng = np.random.RandomState(seed % (2**32))
    return Image.fromarray((rng.rand(size, size, 3) * 255).astype("uint8"))


def image_size_of(model_dir: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True).vision_config.image_size


def add_common_args(p) -> None:
    """The flags every side-by-side benchmark takes."""
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-layers", type=int, default=30, help="decoder layers of the benchmark LLaVA")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="mmkit only: online weight-only quantization of the decoder's linear layers")
    p.add_argument("--large-images", action="store_true",
                   help="1024x768 photos (assets/photos, a distinct crop per request) instead of small random images")
    p.add_argument("--kv-cache-preallocate", action="store_true",
                   help="mmkit only: commit the whole KV cache at start-up (kv_cache_preallocate=True)")


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def proc_status_mb(*fields: str) -> dict[str, float]:
    """VmRSS (now) and/or VmHWM (peak) of this process, in MB, from one read of
    /proc/self/status. Not ru_maxrss: Linux keeps that across fork + exec, so a child would
    report its parent's peak. The kernel folds per-thread RSS counters into VmHWM lazily, so
    VmHWM can trail VmRSS by a page or two: callers take max(VmHWM, VmRSS) as the peak."""
    out = {f: float("nan") for f in fields}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in out:
                out[name] = int(line.split()[1]) / 1024.0
    return out


def build_model(num_layers: int, image_size: int = 224) -> str:
    from bench_model import build_bench_llava

    return str(build_bench_llava(num_layers=num_layers, image_size=image_size))


# ---------------------------------------------------------------------- mmkit
def mmkit_inputs(reqs: list[Request], image_size: int) -> list[dict]:
    return [{"prompt_token_ids": [BOS_ID, IMAGE_ID] + r.text_ids,
             "multi_modal_data": {"image": make_image(r.image_seed, image_size)}} for r in reqs]


def mmkit_params(reqs: list[Request]):
    from mmkit import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]


def build_llm(model_dir: str, dtype: str, **kwargs):
    from mmkit import LLM

    return LLM(model_dir, dtype=dtype, seed=0, **kwargs)


def setup(args, model_dir: str | None = None):
    """What every script does first, from its common flags: threads, the benchmark checkpoint
    (built once, cached), mmkit's LLM. Returns (model_dir, image_size, llm)."""
    global LARGE_IMAGES
    set_threads(args.threads)
    LARGE_IMAGES = bool(getattr(args, "large_images", False))
    workload = getattr(args, "workload", "mixed")
    model_dir = model_dir or build_model(args.num_layers, WORKLOAD_IMAGE_SIZE.get(workload, 224))
    llm_kwargs = {}
    if getattr(args, "no_async_preprocess", False):
        llm_kwargs["async_preprocess"] = False
    if getattr(args, "quantization", None):
        llm_kwargs["quantization"] = args.quantization
    if getattr(args, "kv_cache_preallocate", False):
        llm_kwargs["kv_cache_preallocate"] = True
    return model_dir, image_size_of(model_dir), build_llm(model_dir, args.dtype, **llm_kwargs)


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K and V, every layer, every KV head: 2 * layers * kv_heads * head_dim * element size."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True).text_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    # A hybrid decoder (Qwen3.5): only its full-attention layers keep K/V.
    types = getattr(cfg, "layer_types", None) or []
    num_kv_layers = sum(t != "linear_attention" for t in types[:cfg.num_hidden_layers]) if types \
        else cfg.num_hidden_layers
    return 2 * num_kv_layers * cfg.num_key_value_heads * head_dim * elem


# ---------------------------------------------------------------------- transformers
class HFRunner:
    """transformers' LlavaForConditionalGeneration.generate in left-padded static batches."""

    def __init__(self, model_dir: str, dtype: str) -> None:
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        self.model = LlavaForConditionalGeneration.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), local_files_only=True).eval()
        self.dtype = getattr(torch, dtype)
        cfg = self.model.config
        self.image_size = cfg.vision_config.image_size
        self.num_image_tokens = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
        self.pad_id = self.processor.tokenizer.pad_token_id

    def batch_inputs(self, reqs: list[Request]) -> dict:
        ids = [[BOS_ID] + [IMAGE_ID] * self.num_image_tokens + r.text_ids for r in reqs]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):  # left padding
            input_ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
        images = [make_image(r.image_seed, self.image_size) for r in reqs]
        pixel_values = self.processor.image_processor(images, return_tensors="pt")["pixel_values"]
        return {"input_ids": input_ids, "attention_mask": mask, "pixel_values": pixel_values.to(self.dtype)}

    @torch.inference_mode()
    def generate(self, reqs: list[Request], max_new_tokens: int | None = None, streamer=None) -> torch.Tensor:
        """Greedy, exactly `max_new_tokens` (default: the batch's longest output) new tokens."""
        inputs = self.batch_inputs(reqs)
        n = max_new_tokens or max(r.max_tokens for r in reqs)
        out = self.model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=self.pad_id, streamer=streamer)
        return out[:, inputs["input_ids"].shape[1]:]

    def run_static(self, reqs: list[Request], batch_size: int) -> float:
        """Seconds to serve `reqs` in arrival order, `batch_size` at a time."""
        start = time.perf_counter()
        for i in range(0, len(reqs), batch_size):
            self.generate(reqs[i:i + batch_size])
        return time.perf_counter() - start


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    t = torch.tensor(values, dtype=torch.float64)
    return {f"p{q}": float(torch.quantile(t, q / 100.0)) for q in qs}
