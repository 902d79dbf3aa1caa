"""Loading in bf16 never holds a float32 copy of the model, and gives the same weights and
outputs as the float32 build-then-cast path it replaced (models/meta_init.py,
mmkit/worker/model_loader.py, models/weight_utils.py)."""

import contextlib
import math
import threading
import weakref

import pytest
import torch
from safetensors import safe_open
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import mmkit.worker.model_loader as model_loader
from mmkit import LLM, EngineArgs, SamplingParams
from mmkit.models.meta_init import meta_parameters
from mmkit.models.weight_utils import _cast_as_built
from mmkit.testing import build_tiny_llava

from conftest import make_image, resave_checkpoint


class Float32Bytes(TorchDispatchMode):
    """Live and peak bytes of the float32 CPU storages torch ops create inside the block (a
    storage is counted once, from the op that made it until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu":
                storage = t.untyped_storage()  # the same Python object for the storage's lifetime
                if id(storage) not in self._seen:
                    self._seen.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """Untied, with parameters large next to the float32 buffers built at construction
    (rotary tables of 128 positions), so the float32 model stands out in the tracker."""
    return build_tiny_llava(tmp_path_factory.mktemp("wide"), seed=2, hidden=256, text_layers=4,
                            max_position_embeddings=128)


def _model_config(path, dtype):
    return EngineArgs(model=str(path), dtype=dtype).create_engine_config().model


def _checkpoint_float32_bytes(path) -> int:
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return 4 * total


def _old_path(monkeypatch):
    """The loader as it was: parameters built for real in float32, loaded, then cast."""
    monkeypatch.setattr(model_loader, "meta_parameters", contextlib.nullcontext)


def _load_tracked(mc):
    with Float32Bytes() as tracked:
        model = model_loader.load_model(mc)
    return model, tracked.peak


def test_bf16_load_creates_no_float32_model_and_gives_the_old_weights(wide_ckpt, monkeypatch):
    mc = _model_config(wide_ckpt, "bfloat16")
    fp32_bytes = _checkpoint_float32_bytes(wide_ckpt)  # the float32 model the old path built
    new, new_peak = _load_tracked(mc)
    params = dict(new.named_parameters())
    assert params and all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values()), \
        {n: (p.dtype, p.device) for n, p in params.items() if p.dtype != torch.bfloat16 or p.is_meta}
    with monkeypatch.context() as m:
        _old_path(m)
        old, old_peak = _load_tracked(mc)
    # The tracker sees the old path's float32 model; the new path only ever holds one
    # parameter's construction tensor, the float32 rotary tables and small tower buffers.
    assert old_peak >= fp32_bytes
    assert new_peak < fp32_bytes / 4, (new_peak, fp32_bytes)
    print(f"float32 bytes at the peak: old path {old_peak}, new {new_peak}; float32 model {fp32_bytes}")
    # Same rounding: bit-identical weights and buffers (the decoder's linears are packed; their
    # row-major weights are released on both paths, so compare the packed copies too).
    old_state, new_state = old.state_dict(), new.state_dict()
    assert old_state.keys() == new_state.keys()
    for name, value in old_state.items():
        assert value.dtype == new_state[name].dtype and torch.equal(value, new_state[name]), name
    old_packed = {n: m._packed for n, m in old.named_modules() if getattr(m, "_packed", None) is not None}
    new_packed = {n: m._packed for n, m in new.named_modules() if getattr(m, "_packed", None) is not None}
    assert old_packed.keys() == new_packed.keys()
    generator = torch.Generator().manual_seed(0)
    for name, packed in new_packed.items():
        module = new.get_submodule(name)
        x = torch.randn(3, module.in_features, generator=generator).to(torch.bfloat16)
        assert torch.equal(module(x), old.get_submodule(name)(x)), name


def test_bf16_outputs_unchanged_by_the_meta_build(gqa_tied_ckpt, monkeypatch):
    """Greedy ids and logprobs (image + text) of the new loader equal the old path's."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    prompts = [{"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": make_image(3)}},
               "Tell me a story"]

    def run():
        llm = LLM(str(gqa_tied_ckpt), dtype="bfloat16")
        model = llm.llm_engine.model_runner.model
        tied = model.lm_head.weight is model.language_model.embed_tokens.weight
        outs = llm.generate(prompts, params, use_tqdm=False)
        return tied, [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
                      for o in outs]

    tied, new = run()
    assert tied  # the tied LM head is the embedding Parameter, as before
    with monkeypatch.context() as m:
        _old_path(m)
        _, old = run()
    assert new == old


def test_missing_weights_are_named_not_left_on_meta(tiny_ckpt, tmp_path):
    tower = resave_checkpoint(tiny_ckpt, tmp_path / "tower",
                    lambda s: s.pop("vision_tower.encoder.layers.0.mlp.fc1.bias"))
    with pytest.raises(ValueError, match=r"lacks 1 weights.*vision_tower\.encoder\.layers\.0\.mlp\.fc1\.bias"):
        LLM(str(tower), dtype="bfloat16")
    # An untied LM head is a weight like any other (it used to keep its random init).
    head = resave_checkpoint(tiny_ckpt, tmp_path / "head", lambda s: s.pop("language_model.lm_head.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 weights.*'lm_head\.weight'"):
        LLM(str(head), dtype="bfloat16")


def test_meta_parameters_keeps_buffers_sharing_and_restores_nn_module():
    original = nn.Module.register_parameter

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight  # shared after registration
            frozen = nn.Parameter(torch.ones(2), requires_grad=False)
            self.c, self.d = nn.Module(), nn.Module()
            self.c.p = frozen  # one Parameter object registered twice
            self.d.p = frozen
            self.register_buffer("table", torch.arange(3, dtype=torch.float32) * 2)

    with meta_parameters():
        model = Shared()
    assert nn.Module.register_parameter is original
    assert all(p.is_meta for p in model.parameters())
    assert model.b.weight is model.a.weight and model.c.p is model.d.p
    assert not model.c.p.requires_grad and model.a.weight.requires_grad
    assert torch.equal(model.table, torch.tensor([0.0, 2.0, 4.0]))
    with pytest.raises(RuntimeError, match="boom"), meta_parameters():
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is original
    assert not nn.Linear(2, 2).weight.is_meta
    # another thread building a module meanwhile gets real parameters
    built = []
    with meta_parameters():
        worker = threading.Thread(target=lambda: built.append(nn.Linear(2, 2)))
        worker.start()
        worker.join()
        assert nn.Linear(2, 2).weight.is_meta
    assert not built[0].weight.is_meta and nn.Module.register_parameter is original


@pytest.mark.parametrize("src,dst", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16),
                                     (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
def test_direct_cast_rounds_like_the_float32_detour(src, dst):
    """Every 16-bit pattern (and random float32 values, with neighbours one ulp up) cast straight to the engine dtype
    equals checkpoint -> float32 parameter -> engine dtype, the old path."""
    if src == torch.float32:
        values = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 1e3
        values = torch.cat([values, values.view(torch.int32).add(1).view(torch.float32)])
    else:
        values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(src)
    direct = torch.empty(values.shape, dtype=dst).copy_(_cast_as_built(values, torch.float32))
    detour = values.to(torch.float32).to(dst)
    # bit-identical, except that NaN payloads may differ (a NaN stays a NaN)
    assert torch.equal(direct.isnan(), detour.isnan())
    finite = ~detour.isnan()
    assert torch.equal(direct[finite].view(torch.int16), detour[finite].view(torch.int16))
    # a parameter transformers built in half precision keeps its rounding step
    assert _cast_as_built(values.to(torch.float32), torch.float16).dtype == torch.float16
