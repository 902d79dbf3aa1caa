"""What a model's own forward does around its language model that the backend must repeat.

The backend calls the language model directly (the runner has already merged the item
embeddings), so whatever a composite model's `forward` adds between its inputs and its language
model is declared here, by the HF `model_type` of the checkpoint (one entry per family; the
families verified through the backend add theirs next to their tests):

- `position_offset`: positions the forward shifts (1-indexed positions: `arange + 1`);
- `bidirectional`: attention the forward's mask opens beyond causal, as mmkit's bidirectional
  ranges (`ProcessedPrompt.bidirectional_ranges`; the scheduler computes each in one chunk):
  "image_runs" (each run of image tokens attends to itself in both directions) or "prompt" (the
  whole prompt: a prefix-LM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackendQuirks:
    position_offset: int = 0
    bidirectional: str | None = None  # None | "image_runs" | "prompt"


QUIRKS: dict[str, BackendQuirks] = {
    # Gemma 3: its forward passes the image-token groups as a blockwise mask (or_mask_function).
    "gemma3": BackendQuirks(bidirectional="image_runs"),
    # PaliGemma: 1-indexed positions, the prompt (image + prefix text) attended bidirectionally.
    "paligemma": BackendQuirks(position_offset=1, bidirectional="prompt"),
}


def quirks_of(hf_config: Any) -> BackendQuirks:
    return QUIRKS.get(getattr(hf_config, "model_type", None), BackendQuirks())


def register_quirks(model_type: str, quirks: BackendQuirks) -> None:
    """Declare (or replace) what `model_type`'s forward adds around its language model."""
    QUIRKS[model_type] = quirks


def fix_position_dependent_query(module: Any, query: Any, positions: Any) -> Any:
    """Query scaling a module computed from the positions it assumed (its cache length plus
    the row index), redone for the step's real positions (`positions` [T]). Llama 4's
    no-rotary layers scale queries by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1
    (attention temperature tuning); in a flattened step the module assumed p = 0..T-1. Rows
    whose scale is the same either way (every p < floor_scale - 1) are left untouched, so
    they stay bit-identical to transformers. query: [1, heads, T, head_dim]."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    import torch

    def scale(p):
        return torch.log1p(torch.floor((p.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    assumed = scale(torch.arange(query.shape[2], device=query.device))
    real = scale(positions.to(query.device))
    differ = assumed != real
    if not bool(differ.any()):
        return query
    fixed = query.clone()
    ratio = (real / assumed)[differ].to(torch.float32)
    fixed[:, :, differ] = (query[:, :, differ].float() * ratio[None, None, :, None]).to(query.dtype)
    return fixed
