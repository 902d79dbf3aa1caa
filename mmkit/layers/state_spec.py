"""What a hybrid decoder keeps per request besides its KV blocks: `StateSpec`.

A hybrid decoder (linear-attention or short-convolution layers beside full attention) declares
one `StateSpec` (`ModelCapabilities.state_spec`, from `get_capabilities(hf_config)` on its
model class). Each request then holds one slot: per state layer a convolution window
`[conv_channels, conv_width]` in the model's dtype and, for linear attention, a recurrent state
`[v_heads, k_dim, v_dim]` in float32. The engine sizes and counts slots from it
(mmkit/engine/state_cache_manager.py), the runner allocates the tensors
(mmkit/worker/state_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    layer_ids: tuple[int, ...]  # decoder layers that keep state (their index in the stack)
    conv_channels: int
    conv_width: int  # K - 1 inputs kept for a kernel of K
    recurrent_shape: tuple[int, ...] = ()  # (v_heads, k_dim, v_dim); () for a conv-only layer

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes one request's state takes (all its layers)."""
        elem = torch.empty((), dtype=dtype).element_size()
        conv = self.conv_channels * self.conv_width * elem
        recurrent = 4
        for n in self.recurrent_shape:
            recurrent *= n
        return self.num_layers * (conv + (recurrent if self.recurrent_shape else 0))
