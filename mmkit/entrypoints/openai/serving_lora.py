"""LoRA adapters on `mmkit serve` (vLLM's surface): `--lora-modules name=path`, `model: "name"`
selects an adapter, `GET /v1/models` lists them beside the base model, and
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` add and drop them at run time."""


import json
from typing import Any

from mmkit.entrypoints.openai.errors import OpenAIError
from mmkit.lora.request import LoRARequest


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ...}` -> [(name, path)]."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                obj = json.loads(value)
                modules.append((str(obj["name"]), str(obj["path"])))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"--lora-modules: got {value!r}; expected name=path or "
                                 '\'{"name": ..., "path": ...}\'') from exc
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: got {value!r}; expected name=path")
        modules.append((name, path))
    return modules


class LoRARegistry:
    """Adapters by served name; ids are given in order of registration (1, 2, ...)."""

    def __init__(self) -> None:
        self.requests: dict[str, LoRARequest] = {}
        self._next_id = 1

    def names(self) -> list[str]:
        return list(self.requests)

    def get(self, name: str) -> LoRARequest | None:
        return self.requests.get(name)

    def new_request(self, name: str, path: str) -> LoRARequest:
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request


async def load_adapter(engine: Any, registry: LoRARegistry, served_names: tuple[str, ...], name: Any,
                       path: Any) -> LoRARequest:
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise OpenAIError("lora_name and lora_path: expected non-empty strings", 400, param="lora_name")
    if name in registry.requests or name in served_names:
        raise OpenAIError(f"lora_name: the adapter {name!r} is already loaded", 400, param="lora_name")
    request = registry.new_request(name, path)
    try:
        await engine.add_lora(request)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param="lora_path") from exc
    registry.requests[name] = request
    return request


def add_lora_routes(app: Any, engine: Any, config: Any) -> None:
    """The runtime-loading endpoints (before any catch-all mount). NOTE: this module has no
    `from __future__ import annotations`: FastAPI must see `Request` itself in the handlers'
    signatures (a string annotation naming a local import would become a query parameter)."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse

    registry: LoRARegistry = config.lora

    async def body_of(raw: Request) -> dict:
        try:
            body = await raw.json()
        except ValueError as exc:
            raise OpenAIError("the body must be a JSON object", 400) from exc
        if not isinstance(body, dict):
            raise OpenAIError("the body must be a JSON object", 400)
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        body = await body_of(raw)
        await load_adapter(engine, registry, config.served_model_names, body.get("lora_name"), body.get("lora_path"))
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        body = await body_of(raw)
        name = body.get("lora_name")
        request = registry.requests.pop(name, None) if isinstance(name, str) else None
        if request is None:
            raise OpenAIError(f"lora_name: no adapter named {name!r} is loaded", 404, param="lora_name",
                              code="model_not_found")
        await engine.remove_lora(request.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
