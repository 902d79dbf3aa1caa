"""Calling the server's app without a socket: one HTTP request in, its response out as parts.

`mmkit serve` hands requests to the app through uvicorn; a Ray Serve replica
(`mmkit.ray.serve`) has the request as plain values, sent by its ingress through a
DeploymentHandle, and must stream the answer back through that handle. `call_app` drives the
same ASGI app (routes, API key, media rules, errors, metrics: nothing copied) and yields what
it sends: first a `ResponseStart`, then each body chunk as bytes, so a stream stays a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.types import ASGIApp, Message

logger = logging.getLogger("mmkit.serve")


@dataclass(frozen=True)
class HTTPRequest:
    """What the app needs of one request; plain values, so it pickles between Ray actors."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


async def call_app(app: ASGIApp, request: HTTPRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run `request` through `app`; yields a `ResponseStart`, then the body's chunks.

    Closing the iterator early (the caller's client went away) tells the app the client
    disconnected and cancels it, which aborts the engine request as a dropped socket would.
    An app that fails before it starts a response raises here.
    """
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method.upper(), "scheme": "http", "path": request.path,
             "raw_path": request.path.encode(), "query_string": request.query_string, "root_path": "",
             "headers": [(k.lower(), v) for k, v in request.headers], "client": request.client,
             "server": ("mmkit-replica", 80)}
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()  # the body is read; what comes next is the client leaving
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)  # the app returned (or failed): no more messages

    task = asyncio.ensure_future(run())
    complete = False
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((bytes(k), bytes(v))
                                                            for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    complete = True
                    break
        try:
            await task
        except Exception:
            # NOTE: Starlette re-raises an error after it has sent its 500 answer; the answer
            # is what the client gets (uvicorn, too, only logs it then).
            if not complete:
                raise
            logger.exception("the app raised after its response was sent")
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
