"""The two Ray Serve deployments behind `mmkit.ray.serve.build_app`.

    client -> Serve proxy -> OpenAIIngress (no CPU reserved: it only forwards)
                               | reads the body, computes the routing key (serve_router)
                               v  DeploymentHandle, stream=True, AffinityRouter
                             LLMServer replica x N: mmkit's own OpenAI app on its own engine

Serve's proxy picks a replica before it reads a body, so the affinity decision needs this
ingress. Each `LLMServer` runs the app `mmkit serve` runs (`create_app`), driven without a
socket (`call_app`), so routes, the API key, media rules and errors are the server's own.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mmkit.entrypoints.openai.errors import OpenAIError
from mmkit.entrypoints.openai.in_process import HTTPRequest, ResponseStart
from mmkit.ray.serve_router import routing_key

logger = logging.getLogger("mmkit.serve")

#: The first item every `LLMServer.handle` stream yields: the replica has the request.
ACCEPTED = "accepted"
#: Attempts for a request whose replica died before it accepted the request (never started).
_ATTEMPTS = 3


class LLMServer:
    """One engine replica: an `AsyncLLMEngine` and the server's app over it."""

    def __init__(self, model: str | None, engine_args: dict[str, Any], server_options: dict[str, Any],
                 num_threads: int, enable_ui: bool) -> None:
        import torch

        # NOTE: Serve gives the replica its CPUs as a reservation only; torch would still
        # start one thread per core of the node, so the replica's share is set here.
        torch.set_num_threads(num_threads)
        from mmkit.config import EngineArgs
        from mmkit.engine.async_engine import AsyncLLMEngine
        from mmkit.entrypoints.openai.api_server import create_app, server_config

        self.engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        config = server_config(self.engine, model=model, **server_options)
        self.app = create_app(self.engine, config, enable_ui=enable_ui)

    async def handle(self, request: HTTPRequest, routing_key: str | None = None
                     ) -> AsyncIterator[str | ResponseStart | bytes]:
        """`ACCEPTED`, then the app's `ResponseStart` and body chunks (`routing_key` is the
        router's; the replica does not need it)."""
        from mmkit.entrypoints.openai.in_process import call_app

        yield ACCEPTED
        async for part in call_app(self.app, request):
            yield part

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve asks a replica for (its controller, every few seconds, for the routers;
        `replica_metrics`, directly): this replica's `/metrics` text and its KV cache use."""
        from prometheus_client import generate_latest

        stats = self.engine.engine.get_metrics()
        total = stats["kv_blocks_total"]
        return {"metrics": generate_latest(self.app.state.metrics.registry).decode(),
                "kv_cache_usage": (total - stats["kv_blocks_free"]) / total if total else 0.0}

    def check_health(self) -> None:
        if self.engine.errored:  # Serve replaces a replica whose health check raises
            raise RuntimeError("the engine loop failed")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class OpenAIIngress:
    """Reads each request, picks its routing key, and relays the chosen replica's answer."""

    def __init__(self, server: Any) -> None:
        self.server = server.options(stream=True, method_name="handle")

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = request.scope["path"]
        root = request.scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        client = request.scope.get("client")
        forwarded = HTTPRequest(method=request.method, path=path, query_string=request.scope.get("query_string", b""),
                                headers=tuple((bytes(k), bytes(v)) for k, v in request.scope["headers"]),
                                body=body, client=tuple(client) if client else None)
        key = routing_key(path, body)
        stream = None
        for attempt in range(_ATTEMPTS):
            stream = self.server.remote(forwarded, routing_key=key)
            try:
                await stream.__anext__()  # ACCEPTED
                break
            except Exception as exc:  # noqa: BLE001 - the replica died before it had the request
                if attempt == _ATTEMPTS - 1 or not _replica_died(exc):
                    return _error_response(exc)
                logger.warning("replica died before it accepted a request (%s); retrying", type(exc).__name__)
        try:
            start = await stream.__anext__()
        except Exception as exc:  # noqa: BLE001 - the replica died (or failed) with the request in flight
            return _error_response(exc)
        if not isinstance(start, ResponseStart):
            return _error_response(RuntimeError(f"the replica answered {type(start).__name__} first"))
        if (start.header(b"content-type") or b"").startswith(b"text/event-stream"):
            response: Response = StreamingResponse(_relay_events(stream), status_code=start.status)
        else:  # a whole answer (JSON, a page): collected, so a failure is still a clean 5xx
            chunks = []
            try:
                async for chunk in stream:
                    chunks.append(chunk)
            except Exception as exc:  # noqa: BLE001
                return _error_response(exc)
            response = Response(b"".join(chunks), status_code=start.status)
        response.raw_headers = list(start.headers)
        return response


async def _relay_events(stream: Any) -> AsyncIterator[bytes]:
    """A stream's chunks; if the replica dies mid-stream, an error event then [DONE], so the
    client sees a failure, never a silent stop."""
    from mmkit.entrypoints.openai.streaming import sse_done, sse_error

    done = False
    try:
        async for chunk in stream:
            yield chunk
        done = True
    except Exception as exc:  # noqa: BLE001 - the replica died (or failed) mid-stream
        done = True
        logger.warning("a stream's replica failed: %r", exc)
        yield (sse_error(_replica_error(exc)) + sse_done()).encode()
    finally:
        if not done:  # the client went away: stop the replica's request too
            stream.cancel()


def _replica_died(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))


def _replica_error(exc: BaseException) -> OpenAIError:
    if _replica_died(exc):
        return OpenAIError("the replica serving this request died; send it again", 502, code="replica_died")
    return OpenAIError(f"the replica serving this request failed: {type(exc).__name__}", 500,
                       code="replica_failed")


def _error_response(exc: BaseException) -> JSONResponse:
    error = _replica_error(exc)
    if error.status_code == 500:
        logger.error("request failed in its replica: %r", exc)
    return JSONResponse(error.body(), status_code=error.status_code)
