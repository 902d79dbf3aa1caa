"""The Llama family's decode fast path: the whole decoder stack of a step in one C call
(`mmkit/layers/csrc/decode_stack_cpu.c`, built with the other kernels by `mmkit/layers/cpu_kernels.py`).

At batch 1 the per-module path pays 7-16 us of ctypes and tensor handling around each of about
ten small kernels per layer, close to half of the step on the 30-layer benchmark model. In a
prefill step it allocates every activation afresh, and at 2048 tokens those are tens of MB a
layer that glibc maps and unmaps, so their pages fault and are zeroed again in every layer; the
C stack keeps its activations in one scratch buffer held between steps. It runs the same kernels
in the same order on the same data, so its output is bit-identical to the per-module path; it
only takes the step when every part of every layer is one of those kernels:

- the plain Llama block (`LlamaDecoderLayer` with `LlamaAttention`, a fused SiLU `LlamaMLP`,
  `RMSNorm`s): LLaVA's, LLaVA-NeXT's, Idefics3's / SmolVLM's, Mistral 3's, InternVL's and
  Qwen2-VL's decoders (M-RoPE included: its per-token tables are indexed like the 1-D ones);
- every projection on mmkit's panels (`Linear` bound to `linear_panels`, or `QuantizedLinear`
  bound to `quant_panels`, AVX512-BF16 CPUs), for this many rows;
- a decode-only step with one attention view for every layer (no sliding layer whose window
  cuts a context), or a step with prefill chunks that the paged rows kernel attends as the
  per-module path does (every layer global, `MMKIT_PAGED_PREFILL` on, no chunk with
  bidirectional image spans or a context past `attention.paged_prefill_max_context(head_dim)`);
- no DeepStack features, bf16 or float32 on CPU.

Anything else returns None and the modules run as before. `MMKIT_DECODE_STACK=0` turns it off
(A/B measurements).
"""

from __future__ import annotations

import ctypes

import torch

from mmkit import envs
from mmkit.layers import attention, cpu_kernels, fused_f32, quant_panels
from mmkit.layers.attention import AttentionMetadata, _decode_view, _rows_view
from mmkit.layers.norms import RMSNorm
from mmkit.layers.quantized_linear import QuantizedLinear
from mmkit.layers.rotary import StepRope

_DTYPES = cpu_kernels._DTYPES  # the kernels' dtype codes
# The scratch buffer is kept between steps up to this size (a 2048-token float32 step of the
# 30-layer benchmark model needs 64 MB); a larger step's is allocated for that step only, so
# a long-prompt step does not leave hundreds of MB resident.
KEEP_WORK_BYTES = 128 << 20
_PTR, _I64, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Lora(ctypes.Structure):
    _fields_ = [("a", _PTR), ("bt", _PTR), ("scales", _PTR), ("slot_mask", _PTR), ("bounds", _PTR),
                ("num_slices", _I64), ("rank", _I64)]


class _Linear(ctypes.Structure):
    _fields_ = [("weights", _PTR), ("bias", _PTR), ("scales", _PTR), ("zeros", _PTR),
                ("n", _I64), ("k", _I64), ("group_size", _I64), ("bits", _I64), ("lora", _PTR)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), ("k_cache", _PTR), ("v_cache", _PTR),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear)]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _I64), ("hidden", _I64), ("inter", _I64), ("num_heads", _I64),
                ("num_kv_heads", _I64), ("head_dim", _I64), ("num_blocks", _I64), ("block_size", _I64),
                ("max_blocks", _I64), ("quant_direct_max_rows", _I64),
                ("positions", _PTR), ("slot_mapping", _PTR), ("block_ids", _PTR), ("context_lens", _PTR),
                ("context_starts", _PTR), ("tiles", _PTR), ("num_tiles", _I64), ("cos", _PTR), ("signed_sin", _PTR),
                ("eps", _FLOAT), ("scale", _FLOAT), ("dtype", _INT), ("num_threads", _INT), ("lora_slots", _PTR),
                ("kv_warm", _INT)]


def enabled() -> bool:
    return envs.MMKIT_DECODE_STACK


def _linear_record(mod: torch.nn.Module, dtype: torch.dtype) -> tuple[_Linear, int | None, tuple] | None:
    """(record, rows above which the module leaves the panels or None, tensors to keep alive)."""
    from mmkit.models.llama import Linear  # noqa: PLC0415 - llama.py imports this module
    lora_keep = None
    if hasattr(mod, "lora_record"):  # mmkit/lora/layers.py: the base projection plus its LoRA slots
        lora_keep = mod.lora_record(_Lora)
        if lora_keep is None:
            return None
        mod = mod.base
    got = _base_linear_record(mod, dtype, Linear)
    if got is None or lora_keep is None:
        return got
    rec, rows, alive = got
    rec.lora = ctypes.addressof(lora_keep[0])
    return rec, rows, (alive, lora_keep)


def _base_linear_record(mod: torch.nn.Module, dtype: torch.dtype, Linear) -> tuple[_Linear, int | None, tuple] | None:
    bias = getattr(mod, "bias", None)
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    bias_ptr = bias.data_ptr() if bias is not None else None
    if type(mod) is Linear:
        if mod._run_panels is None or mod._packed.dtype != dtype:
            return None
        rec = _Linear(mod._packed.data_ptr(), bias_ptr, None, None, mod.out_features, mod.in_features, 0, 0)
        return rec, (mod._panel_max_rows if mod._onednn is not None else None), (mod._packed, bias)
    if type(mod) is QuantizedLinear:
        p = mod.panels
        if mod._run_panels is None or p is None or dtype != torch.bfloat16:
            return None
        rec = _Linear(p.q.data_ptr(), bias_ptr, p.scales.data_ptr(), p.zeros.data_ptr() if p.zeros is not None else None,
                      p.out_features, p.in_features, p.group_size, p.bits)
        return rec, mod._panel_max_rows, (p, bias)
    return None


class DecodeStack:
    """The C records of one `LlamaModel`'s layers; `run` takes a decode step or returns None."""

    lora_ctx = None  # mmkit.lora.layers.LoRAContext when the projections carry LoRA slots

    def __init__(self, model: torch.nn.Module, layers: list[_Layer], keep: list, max_rows: int | None,
                 dtype: torch.dtype) -> None:
        self.model, self.dtype, self.max_rows = model, dtype, max_rows
        self.layers = (_Layer * len(layers))(*layers)
        self._keep = keep  # every tensor whose pointer the records hold
        self._cache_ptrs: tuple[int, ...] = ()
        self._work: torch.Tensor | None = None  # scratch kept between steps (KEEP_WORK_BYTES)
        first = model.layers[0]  # build() refuses a stack without layers
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale, self.inter = attn.scale, first.mlp.intermediate_size
        self.windows = {layer.self_attn.sliding_window for layer in model.layers}
        lib = cpu_kernels.library()
        self._run, self._work_bytes = lib.mmkit_decode_stack, lib.mmkit_decode_stack_work_bytes

    @classmethod
    def build(cls, model: torch.nn.Module) -> "DecodeStack | None":
        """None unless every layer of `model` (a `LlamaModel`) is the plain Llama block on panels."""
        from mmkit.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP  # noqa: PLC0415 - (a cycle)
        dtype = model.norm.weight.dtype
        if (not enabled() or not len(model.layers) or cpu_kernels.library() is None or dtype not in _DTYPES or not model.norm.weight.is_cpu
                or (dtype is torch.float32 and not fused_f32.enabled()) or type(model.norm) is not RMSNorm):
            return None
        layers, keep, max_rows = [], [], None
        eps = model.norm.eps
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP
                    or not mlp.is_silu or attn.qkv_proj is None or mlp.gate_up_proj is None
                    or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm
                    or layer.input_layernorm.eps != eps or layer.post_attention_layernorm.eps != eps
                    or (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, mlp.intermediate_size) != (
                        model.layers[0].self_attn.num_heads, model.layers[0].self_attn.num_kv_heads,
                        model.layers[0].self_attn.head_dim, model.layers[0].self_attn.scale,
                        model.layers[0].mlp.intermediate_size)):
                return None  # one set of sizes for every layer (the C records carry none)
            recs = []
            for mod in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                got = _linear_record(mod, dtype)
                if got is None:
                    return None
                rec, rows, alive = got
                recs.append(rec)
                keep.append(alive)
                if rows is not None:
                    max_rows = rows if max_rows is None else min(max_rows, rows)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != dtype or not w.is_contiguous() for w in norms):
                return None
            keep.append(norms)
            layers.append(_Layer(norms[0].data_ptr(), norms[1].data_ptr(), None, None, *recs))
        if not model.norm.weight.is_contiguous():
            return None
        stack = cls(model, layers, keep, max_rows, dtype)
        # LoRA (mmkit/lora/): the step's row -> slot mapping, shared by the wrapped projections
        first = model.layers[0].self_attn.qkv_proj
        stack.lora_ctx = getattr(first, "ctx", None) if hasattr(first, "lora_record") else None
        return stack

    def _bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        ptrs = tuple(t.data_ptr() for kv in kv_caches for t in kv)
        if ptrs != self._cache_ptrs:
            if len(kv_caches) != len(self.layers) or any(
                    t.dtype != self.dtype or not t.is_contiguous() or t.shape != kv_caches[0][0].shape
                    for kv in kv_caches for t in kv):
                return False
            for rec, (k, v) in zip(self.layers, kv_caches):
                rec.k_cache, rec.v_cache = k.data_ptr(), v.data_ptr()
            self._cache_ptrs = ptrs
        return True

    def run(self, embeds: torch.Tensor, rope: StepRope, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata) -> torch.Tensor | None:
        """The final norm's output [num_tokens, hidden] for a step the stack can take, else None."""
        tokens = embeds.shape[0]
        if meta.attend is not None:  # another attention backend was chosen for this step
            return None
        if (tokens == 0 or embeds.dtype is not self.dtype or embeds.dim() != 2 or not embeds.is_cpu
                or not embeds.is_contiguous() or (self.max_rows is not None and tokens > self.max_rows)
                or type(rope) is not StepRope or not rope.use_kernel or not self._bind_caches(kv_caches)):
            return None
        lora_slots = None
        ctx = self.lora_ctx
        if ctx is not None and (ctx.runs or ctx.uniform is not None):
            if ctx.uniform is not None or ctx.num_rows != tokens or ctx.row_slots is None:
                return None
            lora_slots = ctx.row_slots
        tiles = None
        if meta.prefills:
            # As paged_attention does for a global layer: every row (decodes first, then each
            # chunk's tokens) is a decode row whose context ends at its own token.
            if self.windows != {None} or not attention._PAGED_PREFILL:
                return None
            rows = _rows_view(meta, tokens, kv_caches[0][0])
            if rows is None:
                return None
            view, tiles = rows
        else:
            if meta.num_decode_tokens != tokens:
                return None
            views = {id(v): v for v in (_decode_view(meta, w) for w in self.windows)}
            if len(views) != 1:
                return None
            view = next(iter(views.values()))
        tables = rope.rotary
        positions, slots = rope.positions.contiguous(), meta.slot_mapping.contiguous()
        block_ids, lens = view.block_ids.contiguous(), view.context_lens.contiguous()
        starts = view.context_starts.contiguous() if view.context_starts is not None else None
        if tiles is not None:
            tiles = tiles.contiguous()
        if positions.dtype != torch.long or tables.cos.dtype != torch.float32 or not tables.cos.is_contiguous() \
                or not tables.signed_sin.is_contiguous():
            return None
        _, num_blocks, block_size, _ = kv_caches[0][0].shape
        code = _DTYPES[self.dtype]
        hidden = embeds.shape[1]
        work = self._scratch(self._work_bytes(tokens, hidden, self.inter, self.num_heads, self.num_kv_heads,
                                              self.head_dim, code))
        out = torch.empty_like(embeds)
        step = _Step(tokens, hidden, self.inter, self.num_heads, self.num_kv_heads, self.head_dim, num_blocks,
                     block_size, view.max_blocks, quant_panels.DIRECT_MAX_ROWS, positions.data_ptr(), slots.data_ptr(),
                     block_ids.data_ptr(), lens.data_ptr(), starts.data_ptr() if starts is not None else None,
                     tiles.data_ptr() if tiles is not None else None, tiles.numel() - 1 if tiles is not None else 0,
                     tables.cos.data_ptr(), tables.signed_sin.data_ptr(), self.model.norm.eps, self.scale, code,
                     torch.get_num_threads(), lora_slots.data_ptr() if lora_slots is not None else None,
                     int(envs.MMKIT_KV_WARM))
        failed = _I64(-1)
        status = self._run(self.layers, len(self.layers), self.model.norm.weight.data_ptr(), embeds.data_ptr(),
                           out.data_ptr(), work.data_ptr(), ctypes.byref(step), ctypes.byref(failed))
        if status == 1:  # the panels were bound, so the build has them: cannot happen, but say so
            raise RuntimeError("mmkit: decode stack: the panel kernels are missing from this build")
        if status == 2:
            raise IndexError(f"mmkit: decode stack, layer {failed.value}: a block id, slot, context length "
                             "or row tile is out of range")
        if status == 3:
            raise MemoryError(f"mmkit: decode stack, layer {failed.value}: a kernel could not allocate its scratch "
                              "memory")
        return out

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """The step's scratch: the kept buffer (grown when a step needs more, up to
        KEEP_WORK_BYTES), or a buffer for this step alone past that."""
        if nbytes > KEEP_WORK_BYTES:
            return torch.empty(nbytes, dtype=torch.uint8)
        if self._work is None or self._work.numel() < nbytes:
            self._work = None  # free the old one first: the two need not be resident together
            self._work = torch.empty(nbytes, dtype=torch.uint8)
        return self._work
