"""`LoRARequest` (vLLM's name and fields) and the engine's `LoRAConfig`."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Run a request under the adapter saved by PEFT at `lora_path`.

    `lora_int_id` (>= 1) identifies the adapter in the engine's cache: requests naming the same
    id share its loaded weights; `lora_name` is what the server lists and requests select.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request: lora_name: got {self.lora_name!r}; expected a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request: lora_int_id: got {self.lora_int_id!r}; expected an integer >= 1")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise TypeError(f"lora_request: lora_path: got {type(self.lora_path).__name__}; expected a path")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_tag(self) -> bytes:
        """32 bytes that start every prefix-cache chain computed under this adapter (SHA-256,
        stable across processes): a block computed under adapter A never matches under B."""
        return hashlib.sha256(f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}".encode()).digest()


@dataclass(frozen=True)
class LoRAConfig:
    """The engine's LoRA limits (vLLM's names)."""

    max_loras: int = 1  # adapters resident in the model's slots at once (a step holds at most these)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded in memory (LRU); None = max_loras
    enable_tower_connector_lora: bool = False  # adapters on the vision tower and projector too

    @property
    def cpu_capacity(self) -> int:
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)
