"""LoRA adapters served beside one base model, per request (vLLM's multi-LoRA).

- `request.py`: `LoRARequest` (which adapter a request runs under) and `LoRAConfig`;
- `peft_format.py`: reading PEFT's saved adapters (`adapter_config.json` + safetensors);
- `layers.py`: the wrapped projections holding every slot's A/B and the grouped delta;
- `manager.py`: the adapter cache (`max_loras` slots, LRU; `max_cpu_loras` loaded adapters)
  and the per-step row -> slot mapping.
"""

from mmkit.lora.request import LoRAConfig, LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
