"""Checkpoint key names -> mmkit module names, derived from transformers' own conversions.

llava-hf checkpoints exist in several layouts (the hub's transformers-4.x one with
`vision_tower.vision_model.*` and `language_model.model.*`, the one transformers 5 saves, and the
in-memory `model.*`-prefixed one). transformers renames them at load time with the conversion
list it registers per class (`transformers.conversion_mapping`); mmkit runs that same list on a
meta-device skeleton of the checkpoint's transformers class, so a rename transformers adds later
is picked up without a hand-kept table. mmkit's module tree mirrors transformers 5's, minus the
base-model prefix (`model.language_model.x` there is `language_model.x` here).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

KeyMapper = Callable[[str], str]


def transformers_key_mapper(hf_config: Any, architecture: str) -> KeyMapper:
    """A function mapping any checkpoint key of `architecture` to mmkit's parameter name."""
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    hf_class = getattr(transformers, architecture)
    # NOTE: a skeleton on the meta device allocates nothing, whatever the model size.
    with torch.device("meta"):
        skeleton = hf_class(hf_config)
    transforms = get_model_conversion_mapping(skeleton)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    # Converters (fusing/splitting tensors) never apply to the LLaVA families; their keys are
    # left alone so such a checkpoint fails loudly as unexpected weights.
    converters: list = []
    assert all(isinstance(t, (WeightRenaming, WeightConverter)) for t in transforms)
    meta_state = dict.fromkeys(skeleton.state_dict())
    prefix = skeleton.base_model_prefix  # "model"

    def to_mmkit(key: str) -> str:
        hf_key, _ = rename_source_key(key, renamings, converters, prefix, meta_state)
        if hf_key not in meta_state and key in meta_state:
            hf_key = key
        # transformers 5's `model.<part>` is mmkit's `<part>` (no base-model level).
        return hf_key[len(prefix) + 1:] if hf_key.startswith(prefix + ".") else hf_key

    return to_mmkit
