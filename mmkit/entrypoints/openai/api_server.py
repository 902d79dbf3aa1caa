"""The FastAPI app (`create_app`) and the uvicorn runner (`run_server`) behind `mmkit serve`.

Routes: `GET /health`, `GET /version`, `GET /v1/models`, `POST /v1/chat/completions`,
`POST /v1/completions`, `POST /v1/responses` (stateless), `POST /tokenize`, `POST /detokenize`, `GET /metrics`, and the
playground page at `/` when `mmkit/entrypoints/ui/` is present.
Every error is OpenAI's JSON body; a client's bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import mmkit
from mmkit.engine.async_engine import AsyncLLMEngine
from mmkit.entrypoints.openai.errors import OpenAIError
from mmkit.entrypoints.openai.metrics import ServerMetrics
from mmkit.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                               DetokenizeResponse, ModelCard, ModelList, ResponsesRequest,
                                               TokenizeRequest, TokenizeResponse)
from mmkit.entrypoints.openai.serving_chat import OpenAIServingChat
from mmkit.entrypoints.openai.serving_completion import OpenAIServingCompletion
from mmkit.entrypoints.openai.serving_engine import ClientDisconnected, ServerConfig, default_sampling_from
from mmkit.entrypoints.openai.serving_responses import OpenAIServingResponses
from mmkit.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("mmkit.serve")

#: The playground's static files (index.html, app.js, style.css), served at `/` when present.
UI_DIR = Path(__file__).resolve().parent.parent / "ui"
_OPEN_PATHS = ("/health",)


def create_app(engine: AsyncLLMEngine, config: ServerConfig, *, enable_ui: bool = True,
               ui_dir: Path | None = None) -> FastAPI:
    """One app over one engine. `enable_ui` serves `ui_dir` (default `UI_DIR`) at `/` if it exists."""
    disable_created_metrics()  # no `*_created` series: they only clutter the scrape
    app = FastAPI(title="mmkit OpenAI-compatible server", docs_url="/docs", redoc_url=None)
    metrics = ServerMetrics(engine)
    chat = OpenAIServingChat(engine, config, metrics)
    completion = OpenAIServingCompletion(engine, config, metrics)
    responses = OpenAIServingResponses(engine, config, metrics)
    tokenization = OpenAIServingTokenization(engine, config, metrics)
    app.state.engine, app.state.config, app.state.metrics = engine, config, metrics
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return JSONResponse(OpenAIError("the engine loop failed", 503).body(), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": mmkit.__version__}

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        root = engine.engine.config.model.path
        cards = [ModelCard(id=name, root=root, max_model_len=config.max_model_len)
                 for name in config.served_model_names]
        if config.lora is not None:  # adapters beside the base model (vLLM lists them so)
            cards += [ModelCard(id=name, root=r.lora_path, parent=config.model_name, max_model_len=config.max_model_len)
                      for name, r in config.lora.requests.items()]
        return ModelList(data=cards)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request):
        return await responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        raise OpenAIError(f"response_id: no stored response {response_id[:80]!r}; mmkit serve keeps no responses "
                          "(stateless)", 404, param="response_id", code="not_found")

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(request)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(request)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if config.lora is not None:
        from mmkit.entrypoints.openai.serving_lora import add_lora_routes

        add_lora_routes(app, engine, config)
    ui = ui_dir or UI_DIR
    if enable_ui and (ui / "index.html").is_file():
        from fastapi.staticfiles import StaticFiles

        # Mounted last: the API routes above match first.
        app.mount("/", StaticFiles(directory=str(ui), html=True), name="ui")
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, ui_enabled=enable_ui)
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        # Added last, so it is outermost: a browser's preflight carries no key and must pass.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every route but /health (and the playground's static files,
    which hold no data: the page asks for the key and sends it with its API calls)."""

    def __init__(self, app: ASGIApp, api_key: str, ui_enabled: bool) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.ui_enabled = ui_enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        error = OpenAIError("Incorrect API key provided" if given else "Missing API key: send 'Authorization: "
                            "Bearer KEY'", 401, code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401)(scope, receive, send)

    def _is_open(self, scope: Scope) -> bool:
        path = scope.get("path", "")
        if path in _OPEN_PATHS:
            return True
        api = path.startswith("/v1/") or path in ("/metrics", "/docs", "/openapi.json", "/tokenize",
                                                  "/detokenize", "/version")
        return self.ui_enabled and scope.get("method") in ("GET", "HEAD") and not api


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        request.app.state.metrics.count_rejected(exc.status_code)
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        request.app.state.metrics.count_rejected(400)
        # OpenAI answers 400 (not FastAPI's 422) for a body it cannot use, bad JSON included.
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        if loc and loc[0] == "prompt" and len(loc) > 1:  # a union: name the forms, not each member's error
            message = ("prompt: expected a string, a list of strings, a list of token ids or a list of "
                       f"token-id lists (got {repr(first.get('input'))[:80]})")
            param = "prompt"
        elif loc and loc[0] == "input" and len(loc) > 1:  # the Responses API's union, likewise
            message = f"input: expected a string or a list of input messages (got {repr(first.get('input'))[:80]})"
            param = "input"
        elif first.get("type") == "json_invalid":
            message = f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
            param = None
        else:
            shown = repr(first.get("input"))[:80]
            message = f"{param or 'body'}: {first.get('msg', 'invalid')} (got {shown})"
        return JSONResponse(OpenAIError(message, 400, param=param).body(), status_code=400)

    @app.exception_handler(ClientDisconnected)
    async def client_disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(OpenAIError(str(exc.detail), exc.status_code).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return JSONResponse(OpenAIError(f"internal server error: {type(exc).__name__}", 500).body(),
                            status_code=500)


# ---------------------------------------------------------------------- runner
class _Server(uvicorn.Server):
    """uvicorn's server; a SIGINT/SIGTERM aborts the in-flight requests and exits with status 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, ready_message) -> None:
        super().__init__(config)
        self.engine = engine
        self.ready_message = ready_message
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            print(self.ready_message(port), flush=True)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        # NOTE: uvicorn re-raises a captured signal after a graceful stop (so the process dies
        # of it); a signal is how a server is meant to stop, so the exit status stays 0.
        if hasattr(self, "_captured_signals"):
            self._captured_signals.clear()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.engine.shutdown)  # streams end now, not at their end


def build_engine_args(args: Any):
    from mmkit.config import EngineArgs

    return EngineArgs(model=args.model, **engine_kwargs(args))


def engine_kwargs(args: Any) -> dict[str, Any]:
    """`mmkit serve`'s engine flags as `EngineArgs` fields (all but `model`)."""
    kwargs: dict[str, Any] = dict(
        dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_gpu_blocks_override, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, tokenizer=args.tokenizer,
        quantization=getattr(args, "quantization", None),
        model_impl=getattr(args, "model_impl", "auto"),
        kv_cache_preallocate=getattr(args, "kv_cache_preallocate", False),
        enforce_eager=getattr(args, "enforce_eager", False),
        attention_backend=getattr(args, "attention_backend", "auto"),
        mm_processor_workers=getattr(args, "mm_processor_workers", 0))
    if args.limit_mm_per_prompt is not None:
        kwargs["limit_mm_per_prompt"] = args.limit_mm_per_prompt
    if getattr(args, "enable_lora", False):
        kwargs.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras,
                      enable_tower_connector_lora=args.enable_tower_connector_lora)
    return kwargs


def split_flag_values(values: list[str] | None) -> tuple[str, ...]:
    """`a,b c` -> ("a", "b", "c"): list flags take commas, spaces or both."""
    return tuple(v.strip() for value in values or () for v in value.split(",") if v.strip())


def read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def check_generation_config(value: str) -> None:
    """`--generation-config`: 'auto', 'vllm' or a folder holding generation_config.json."""
    if value not in ("auto", "vllm") and not (Path(value) / "generation_config.json").is_file():
        raise ValueError(f"--generation-config: {value!r} holds no generation_config.json; "
                         "expected 'auto', 'vllm' or such a folder")


def server_config(engine: AsyncLLMEngine, *, model: str | None, served_model_name: Any, media: Any,
                  chat_template: str | None, api_key: str | None, allowed_origins: Any,
                  generation_config: str = "auto", announce: bool = False) -> ServerConfig:
    """What `create_app` needs besides the engine, from `mmkit serve`'s options (also what each
    Ray Serve replica builds: `mmkit.ray.serve`). `served_model_name`: a name, a list, or None
    (then `model`, else 'default-model'); `allowed_origins`: a list of flag values or None."""
    if isinstance(served_model_name, str):
        served_model_name = [served_model_name]
    names = tuple(served_model_name or [model or "default-model"])
    source = {"auto": engine.engine.config.model.path, "vllm": None}.get(generation_config, generation_config)
    default_sampling = default_sampling_from(source)
    if default_sampling and announce:
        print(f"mmkit serve: sampling defaults from the generation config: {default_sampling}", flush=True)
    return ServerConfig(served_model_names=names, max_model_len=engine.engine.config.scheduler.max_model_len,
                        media=media, chat_template=chat_template, api_key=api_key or None,
                        allowed_origins=split_flag_values(allowed_origins), default_sampling=default_sampling)


def with_lora_modules(engine: AsyncLLMEngine, config: ServerConfig, lora_modules: list[str] | None) -> ServerConfig:
    """`config` serving the adapters of `--lora-modules` (each loaded and checked now: a bad
    one fails the start with its cause)."""
    import dataclasses

    from mmkit.entrypoints.openai.serving_lora import LoRARegistry, parse_lora_modules

    registry = LoRARegistry()
    for name, path in parse_lora_modules(lora_modules):
        if name in registry.requests or name in config.served_model_names:
            raise ValueError(f"--lora-modules: the name {name!r} is used twice")
        request = registry.new_request(name, path)
        engine.engine.add_lora(request)
        registry.requests[name] = request
    return dataclasses.replace(config, lora=registry)


def run_server(args: Any) -> int:
    """Load the model, then serve until SIGINT/SIGTERM; returns the exit status (0)."""
    import torch

    from mmkit.entrypoints.openai.media import MediaPolicy

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"mmkit serve: loading {args.model or 'the embedded default model'} ...", flush=True)
    start = time.perf_counter()
    media = MediaPolicy.from_args(args.allowed_local_media_path,
                                  list(split_flag_values(args.allowed_media_domains)),
                                  image_fetch_timeout=args.image_fetch_timeout,
                                  max_image_fetch_bytes=args.max_image_fetch_bytes,
                                  max_image_pixels=args.max_image_pixels)
    chat_template = read_chat_template(args.chat_template)
    check_generation_config(args.generation_config)
    engine = AsyncLLMEngine.from_engine_args(build_engine_args(args))
    print(f"mmkit serve: model loaded in {time.perf_counter() - start:.1f} s", flush=True)
    config = server_config(engine, model=args.model, served_model_name=args.served_model_name, media=media,
                           chat_template=chat_template, api_key=args.api_key, allowed_origins=args.allowed_origins,
                           generation_config=args.generation_config, announce=True)
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules: needs --enable-lora")
    if getattr(args, "enable_lora", False):
        config = with_lora_modules(engine, config, getattr(args, "lora_modules", None))
    names = config.served_model_names
    app = create_app(engine, config, enable_ui=args.enable_ui)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                               timeout_graceful_shutdown=5, lifespan="off")
    host = f"[{args.host}]" if ":" in args.host else args.host
    server = _Server(uv_config, engine,
                     lambda port: f"mmkit serve: {names[0]} ready at http://{host}:{port}/v1")
    # `mmkit serve` bound the socket before loading the model (a taken port fails at once).
    sock = getattr(args, "listen_socket", None)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        engine.shutdown()
    return 0 if server.started else 1
