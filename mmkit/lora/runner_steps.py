"""What the model runner does for LoRA in a step: adapters into slots, rows -> slots."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from mmkit.lora.manager import LoRAManager


def lora_id(state: Any) -> int:
    """The sort key of a sequence's rows: 0 for the base model, else its adapter id."""
    request = getattr(state, "lora_request", None)
    return 0 if request is None else request.lora_int_id


def begin_step(manager: LoRAManager, states: Sequence[Any], row_counts: Sequence[int]) -> None:
    """Put the step's adapters into slots and publish each row's slot (`row_counts[i]` rows of
    `states[i]`, in the step's row order)."""
    requests = {}
    for state in states:
        request = getattr(state, "lora_request", None)
        if request is not None:
            requests[request.lora_int_id] = request
    if not requests:
        manager.clear()
        return
    slots = manager.activate(requests)
    rows: list[int] = []
    for state, count in zip(states, row_counts):
        request = state.lora_request
        rows.extend([slots[request.lora_int_id] if request is not None else -1] * count)
    manager.set_rows(rows)


@contextlib.contextmanager
def rows_of(manager: LoRAManager | None, states: Sequence[Any]) -> Iterator[None]:
    """Within the block, row i runs under `states[i]`'s adapter (the LM head on sampled rows);
    the step's mapping is restored after."""
    if manager is None:
        yield
        return
    saved = (manager.ctx.runs, manager.ctx.row_slots, manager.ctx.num_rows)
    slots = {}
    for state in states:
        request = getattr(state, "lora_request", None)
        if request is not None:
            slots[request.lora_int_id] = manager.slots.get(request.lora_int_id, -1)
    manager.set_rows([slots.get(lora_id(s), -1) if lora_id(s) else -1 for s in states])
    try:
        yield
    finally:
        manager.ctx.runs, manager.ctx.row_slots, manager.ctx.num_rows = saved


def encoder_groups(inputs: Sequence[Any]) -> list[tuple[Any, list[int]]]:
    """Items' indices grouped by the adapter their tower pass runs under (None: the base)."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, e in enumerate(inputs):
        request = getattr(e, "lora_request", None)
        key = 0 if request is None else request.lora_int_id
        groups.setdefault(key, (request, []))[1].append(i)
    return list(groups.values())


def encode_per_adapter(manager: LoRAManager, model: Any, inputs: Sequence[Any], item_inputs: list) -> list:
    """`model.embed_multimodal` once per adapter among the items (tower LoRA): each group's tower
    and projector run under its adapter; results come back in item order."""
    out: list = [None] * len(inputs)
    requests = {r.lora_int_id: r for r, _ in encoder_groups(inputs) if r is not None}
    slots = manager.activate(requests) if requests else {}
    saved = manager.ctx.uniform
    try:
        for request, indices in encoder_groups(inputs):
            manager.ctx.uniform = slots[request.lora_int_id] if request is not None else None
            for i, emb in zip(indices, model.embed_multimodal([item_inputs[i] for i in indices])):
                out[i] = emb
    finally:
        manager.ctx.uniform = saved
    return out
