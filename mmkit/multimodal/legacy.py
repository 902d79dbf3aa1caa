"""The legacy keyword arguments (`prompts=`, `prompt_token_ids=`, `multi_modal_data=`),
translated into the consolidated `inputs` form with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from PIL import Image

from mmkit.multimodal.parse import MultiModalData, multi_modal_from_dict

_NEW_FORMS = {
    "prompts": "llm.generate(\"text\") or llm.generate([\"text\", ...])",
    "prompt": "llm.generate({\"prompt\": \"text\"})",
    "prompt_token_ids": "llm.generate({\"prompt_token_ids\": [...]})",
    "multi_modal_data": "llm.generate({\"prompt\": \"USER: <image>...\", \"multi_modal_data\": "
                        "MultiModalData(type=MultiModalData.Type.IMAGE, data=image)})",
}


def _warn(api: str, name: str, stacklevel: int) -> None:
    warnings.warn(
        f"{api}({name}=...) is deprecated; pass `inputs` instead, e.g. {_NEW_FORMS[name]}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def _as_list(value: Any, is_single) -> tuple[list, bool]:
    if is_single(value):
        return [value], True
    if isinstance(value, (list, tuple)):
        return list(value), False
    raise TypeError(f"got {type(value).__name__}; expected a single value or a list")


def legacy_to_inputs(prompts: Any, prompt_token_ids: Any, multi_modal_data: Any,
                     api: str = "LLM.generate", prompt_name: str = "prompts", stacklevel: int = 3) -> list[dict]:
    """Build the new-style inputs list from legacy arguments (warning for each one used)."""
    if prompts is not None:
        _warn(api, prompt_name, stacklevel)
    if prompt_token_ids is not None:
        _warn(api, "prompt_token_ids", stacklevel)
    if multi_modal_data is not None:
        _warn(api, "multi_modal_data", stacklevel)
    if prompts is None and prompt_token_ids is None:
        raise ValueError(f"{api}: got neither {prompt_name} nor prompt_token_ids; pass `inputs`")
    texts = ids_list = None
    if prompts is not None:
        texts, _ = _as_list(prompts, lambda v: isinstance(v, str))
    if prompt_token_ids is not None:
        ids_list, _ = _as_list(prompt_token_ids, lambda v: isinstance(v, (list, tuple)) and
                               (len(v) == 0 or isinstance(v[0], int)))
    if texts is not None and ids_list is not None and len(texts) != len(ids_list):
        raise ValueError(
            f"{api}: {prompt_name} has {len(texts)} entries but prompt_token_ids has {len(ids_list)}; "
            "expected the same length"
        )
    count = len(ids_list if ids_list is not None else texts)
    if count == 0:
        raise ValueError(f"{api}: got an empty list of prompts; expected at least one")
    inputs: list[dict] = []
    for i in range(count):
        item: dict = ({"prompt_token_ids": list(ids_list[i])} if ids_list is not None
                      else {"prompt": texts[i]})
        inputs.append(item)
    if multi_modal_data is not None:
        for item, mm in zip(inputs, _split_multi_modal(api, multi_modal_data, count)):
            if mm is not None:
                item["multi_modal_data"] = mm
    return inputs


def _split_multi_modal(api: str, mm: Any, count: int) -> list[Any]:
    """A batched legacy tensor has one row per prompt: row i goes to prompt i."""
    if isinstance(mm, dict):
        mm = multi_modal_from_dict(f"{api}: multi_modal_data", mm)
    if isinstance(mm, (list, tuple)):
        if len(mm) != count:
            raise ValueError(f"{api}: multi_modal_data has {len(mm)} entries for {count} prompts; expected one per prompt")
        return list(mm)
    if not isinstance(mm, MultiModalData):
        raise TypeError(f"{api}: multi_modal_data: got {type(mm).__name__}; expected MultiModalData")
    data = mm.data
    if isinstance(data, torch.Tensor):
        batched = data.dim() == 4 if mm.type is MultiModalData.Type.IMAGE else data.dim() == 3
        if not batched:
            data = data.unsqueeze(0)
        if data.shape[0] != count:
            raise ValueError(
                f"{api}: multi_modal_data tensor of shape {tuple(data.shape)} has {data.shape[0]} rows for "
                f"{count} prompts; expected one row per prompt"
            )
        return [MultiModalData(type=mm.type, data=data[i:i + 1]) for i in range(count)]
    if isinstance(data, Image.Image) or count == 1:
        if count != 1:
            raise ValueError(f"{api}: one image for {count} prompts; expected one row per prompt")
        return [mm]
    if isinstance(data, (list, tuple)) and len(data) == count:
        return [MultiModalData(type=mm.type, data=img) for img in data]
    raise ValueError(f"{api}: multi_modal_data does not have one entry per prompt ({count} prompts)")


def legacy_single_input(inputs: Any, prompt: Any, prompt_token_ids: Any, multi_modal_data: Any,
                        api: str) -> dict:
    if inputs is not None:
        raise ValueError(f"{api}: got both `inputs` and legacy prompt arguments; pass only `inputs`")
    items = legacy_to_inputs(prompt, prompt_token_ids, multi_modal_data, api=f"LLMEngine.{api}",
                             prompt_name="prompt", stacklevel=4)
    if len(items) != 1:
        raise ValueError(f"LLMEngine.{api}: legacy arguments describe {len(items)} prompts; expected one")
    return items[0]
