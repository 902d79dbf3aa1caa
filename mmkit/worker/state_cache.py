"""The runner's per-request state tensors of a hybrid decoder, one slot per live request.

Slot numbers come from the engine (mmkit/engine/state_cache_manager.py) with each new
sequence; the runner zeroes a slot when a sequence starts from token 0 (a new request, or a
preempted one recomputed from scratch), so no state of an earlier owner leaks in. Layers read
and write their slot rows in place through the step's `StateBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmkit.layers.state_spec import StateSpec


class StateCache:
    def __init__(self, spec: StateSpec, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self.num_slots = num_slots
        # per state layer: [num_slots, channels, K-1] in the model dtype (the conv inputs' dtype)
        self.conv = [torch.zeros(num_slots, spec.conv_channels, spec.conv_width, dtype=dtype, device=device)
                     for _ in spec.layer_ids]
        # per state layer: [num_slots, v_heads, k_dim, v_dim] float32 (transformers keeps it float32)
        self.recurrent = [torch.zeros(num_slots, *spec.recurrent_shape, dtype=torch.float32, device=device)
                          for _ in spec.layer_ids] if spec.recurrent_shape else []
        self._index = {layer: i for i, layer in enumerate(spec.layer_ids)}

    def reset(self, slot: int) -> None:
        for t in self.conv:
            t[slot].zero_()
        for t in self.recurrent:
            t[slot].zero_()

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(conv windows, recurrent states or None) of decoder layer `layer_id`, every slot."""
        i = self._index[layer_id]
        return self.conv[i], (self.recurrent[i] if self.recurrent else None)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.recurrent)


@dataclass(frozen=True)
class StateBatch:
    """This step's rows as the state layers see them: `num_decodes` one-token rows first (one
    per sequence, slots `decode_slots`), then each prefill chunk `(row_start, num_tokens, slot)`."""

    cache: StateCache
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64
    prefills: tuple[tuple[int, int, int], ...]
