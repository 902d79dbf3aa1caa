"""The adapter cache: `max_loras` slots in the model (LRU) and `max_cpu_loras` loaded adapters.

`LoRAManager(model, config)` wraps the model's projections once (`LoRALinear`, `LoRAEmbedding`);
`check(request)` loads and validates an adapter before its request is added (a ValueError naming
the cause), `activate(ids)` puts a step's adapters into slots (evicting the least recently used
slot no row of the step needs), and `set_rows(slots)` publishes the step's row -> slot mapping.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from mmkit.lora.layers import LoRAContext, LoRAEmbedding, LoRALinear
from mmkit.lora.peft_format import PeftAdapter, is_tower_module, load_peft_adapter
from mmkit.lora.request import LoRAConfig, LoRARequest

# Fused decoder projections: mmkit's module name -> the checkpoint names it holds, in order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _is_linear(module: nn.Module) -> bool:
    return isinstance(getattr(module, "in_features", None), int) and isinstance(
        getattr(module, "out_features", None), int) and not isinstance(module, (LoRALinear,))


def _fused_slices(name: str, parent: nn.Module, module: nn.Module) -> list[tuple[str, int]] | None:
    """[(checkpoint name, output width)] of a fused projection, None when not fused."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "qkv_proj" and hasattr(parent, "num_kv_heads"):
        q = parent.num_heads * parent.head_dim
        kv = parent.num_kv_heads * parent.head_dim
        if q + 2 * kv == module.out_features:
            return list(zip(_FUSED[leaf], (q, kv, kv)))
    if leaf == "gate_up_proj" and hasattr(parent, "intermediate_size"):
        inter = parent.intermediate_size
        if 2 * inter == module.out_features:
            return list(zip(_FUSED[leaf], (inter, inter)))
    return None


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.ctx = LoRAContext()
        # checkpoint-style module name -> (wrapped module, slice index)
        self.targets: dict[str, tuple[nn.Module, int]] = {}
        self.tower_names: set[str] = set()  # tower/projector modules (wrapped only with tower LoRA)
        self._wrap(model, dtype, device)
        from mmkit.layers import linear_panels  # noqa: PLC0415 - the C decode stack is built again (with LoRA)

        linear_panels.bump_generation()
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.loaded: OrderedDict[int, tuple[LoRARequest, PeftAdapter]] = OrderedDict()  # the CPU cache (LRU)
        self.num_loads = 0  # adapters read from disk (tests: eviction and reload)
        self.num_slot_loads = 0  # adapters copied into a slot

    # ------------------------------------------------------------------ wrapping
    def _wrap(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        cfg = self.config
        R, n = cfg.max_lora_rank, cfg.max_loras
        # float32 slots on CPU (the C decode stack reads them so; tiny next to the weights)
        dtype = torch.float32 if device.type == "cpu" else dtype
        found = []
        for name, module in model.named_modules():
            if not name:
                continue
            tower = is_tower_module(name)
            if tower and not cfg.enable_tower_connector_lora:
                if _is_linear(module):
                    self.tower_names.add(name)
                continue
            if not (tower or name.startswith("language_model.") or name == "lm_head"):
                continue
            if isinstance(module, nn.Embedding) and name.endswith("embed_tokens") and not tower:
                found.append((name, module, None))
            elif _is_linear(module) and type(module).__name__ not in ("LoRAEmbedding",):
                found.append((name, module, None))
        for name, module, _ in found:
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if isinstance(module, nn.Embedding):
                wrapped = LoRAEmbedding(module, n, R, self.ctx, dtype, device)
                self.targets[name] = (wrapped, 0)
            else:
                fused = _fused_slices(name, parent, module)
                slices = [w for _, w in fused] if fused else [module.out_features]
                wrapped = LoRALinear(module, slices, n, R, self.ctx, dtype, device)
                if fused:
                    for i, (ckpt_name, _) in enumerate(fused):
                        self.targets[f"{parent_name}.{ckpt_name}"] = (wrapped, i)
                else:
                    self.targets[name] = (wrapped, 0)
            setattr(parent, leaf, wrapped)
            if tower:
                self.tower_names.add(name)

    # ------------------------------------------------------------------ adapters
    def check(self, request: LoRARequest) -> PeftAdapter:
        """Load (or find loaded) and validate `request`'s adapter; ValueError naming the cause."""
        got = self.loaded.get(request.lora_int_id)
        if got is not None:
            known, adapter = got
            if (known.lora_path, known.lora_name) != (request.lora_path, request.lora_name):
                raise ValueError(f"lora_request: lora_int_id {request.lora_int_id} is already adapter "
                                 f"{known.lora_name!r} ({known.lora_path!r}); got {request.lora_name!r} "
                                 f"({request.lora_path!r}): one id per adapter")
            self.loaded.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_peft_adapter(request.lora_path)
        self._validate(request, adapter)
        self.loaded[request.lora_int_id] = (request, adapter)
        self.num_loads += 1
        while len(self.loaded) > self.config.cpu_capacity:
            victim = next((i for i in self.loaded if i not in self.slots), None)
            if victim is None:
                break
            del self.loaded[victim]
        return adapter

    def _validate(self, request: LoRARequest, adapter: PeftAdapter) -> None:
        where = f"lora_request {request.lora_name!r} ({request.lora_path})"
        if adapter.rank > self.config.max_lora_rank:
            raise ValueError(f"{where}: rank {adapter.rank} is above max_lora_rank = {self.config.max_lora_rank}; "
                             f"pass max_lora_rank={adapter.rank} (or more)")
        leaves = {name.rsplit(".", 1)[-1] for name in list(self.targets) + list(self.tower_names)}
        for target in adapter.target_list:
            if target.rsplit(".", 1)[-1] not in leaves:
                raise ValueError(f"{where}: target module {target!r} is not a module of this model")
        for name, weights in adapter.modules.items():
            if name not in self.targets:
                if name in self.tower_names:
                    raise ValueError(f"{where}: module {name!r} is on the vision tower/projector; pass "
                                     "enable_tower_connector_lora=True to serve adapters there")
                raise ValueError(f"{where}: target module {name!r} is not a module of this model")
            module, index = self.targets[name]
            if isinstance(module, LoRAEmbedding) != weights.is_embedding:
                raise ValueError(f"{where}: module {name!r}: an embedding adapter on a linear module (or the reverse)")
            try:
                probe_a = weights.a
                if isinstance(module, LoRALinear):
                    width = module.slices[index]
                    ok = probe_a.shape[1] == module.in_features and weights.b.shape[0] == width
                else:
                    ok = probe_a.shape[0] == module.num_embeddings and weights.b.shape[0] == module.embedding_dim
            except (AttributeError, IndexError):  # pragma: no cover - malformed tensors
                ok = False
            if not ok:
                raise ValueError(f"{where}: module {name!r}: A {tuple(weights.a.shape)} / B {tuple(weights.b.shape)} "
                                 "do not fit the model's shapes (another base model, or a resized vocabulary)")

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot and its loaded weights); False if unknown."""
        known = lora_int_id in self.loaded or lora_int_id in self.slots
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            self._clear_slot(slot)
        self.loaded.pop(lora_int_id, None)
        return known

    def activate(self, requests: dict[int, LoRARequest]) -> dict[int, int]:
        """Slots for a step's adapters (id -> slot), loading the missing ones."""
        if len(requests) > self.config.max_loras:  # pragma: no cover - the scheduler's invariant
            raise RuntimeError(f"a step holds {len(requests)} adapters; max_loras = {self.config.max_loras}")
        for lora_id in requests:
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
        for lora_id, request in requests.items():
            if lora_id in self.slots:
                continue
            adapter = self.check(request)
            used = set(self.slots.values())
            free = [s for s in range(self.config.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self.slots if i not in requests)
                slot = self.slots.pop(victim)
                self._clear_slot(slot)
            self._fill_slot(slot, adapter)
            self.slots[lora_id] = slot
        return {lora_id: self.slots[lora_id] for lora_id in requests}

    def _clear_slot(self, slot: int) -> None:
        for module in {id(m): m for m, _ in self.targets.values()}.values():
            module.clear_slot(slot)

    def _fill_slot(self, slot: int, adapter: PeftAdapter) -> None:
        self._clear_slot(slot)
        for name, w in adapter.modules.items():
            module, index = self.targets[name]
            module.set_slot(slot, index, w.a, w.b, w.scale)
        self.num_slot_loads += 1

    # ------------------------------------------------------------------ steps
    def set_rows(self, slots: list[int]) -> None:
        self.ctx.set_rows(slots)

    def clear(self) -> None:
        self.ctx.clear()
