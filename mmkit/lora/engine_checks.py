"""The checks of a request's `lora_request`, before anything of the call is added."""

from __future__ import annotations

from typing import Any, Sequence

from mmkit.lora.request import LoRARequest


def check_lora_request(engine: Any, request_id: str, index: int, lora_request: Any) -> None:
    """ValueError/TypeError naming the input and the cause; loads the adapter into the cache."""
    where = f"inputs[{index}] (request {request_id!r})"
    if not isinstance(lora_request, LoRARequest):
        raise TypeError(f"{where}: lora_request: got {type(lora_request).__name__}; expected mmkit.LoRARequest or None")
    manager = getattr(engine.model_runner, "lora_manager", None)
    if manager is None:
        raise ValueError(f"{where}: lora_request {lora_request.lora_name!r} given, but this engine was built without "
                         "LoRA; pass enable_lora=True (and max_loras, max_lora_rank) to LLM / EngineArgs")
    try:
        manager.check(lora_request)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def lora_request_list(lora_request: Any, count: int) -> list[Any]:
    """One entry per input from `lora_request` (one request for all, or a list of one per input)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != count:
            raise ValueError(f"lora_request: got a list of {len(lora_request)}; expected one LoRARequest or a list of "
                             f"{count} (one per input, None for the base model)")
        for i, r in enumerate(lora_request):
            if r is not None and not isinstance(r, LoRARequest):
                raise TypeError(f"lora_request[{i}]: got {type(r).__name__}; expected LoRARequest or None")
        return list(lora_request)
    raise TypeError(f"lora_request: got {type(lora_request).__name__}; expected LoRARequest, a list of them, or None")


def check_all(engine: Any, ids: Sequence[str], requests: Sequence[Any]) -> None:
    for i, (rid, r) in enumerate(zip(ids, requests)):
        if r is not None:
            check_lora_request(engine, rid, i, r)
