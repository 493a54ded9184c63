"""WebSocket streaming: several requests on one connection, each cancellable.

Protocol (documented in the README):
- client -> server: a chat or completions request body (``messages`` or ``prompt``) plus a
  client-chosen ``request_id``; or ``{"type": "cancel", "request_id": ...}``.
- server -> client: the same chunk objects as SSE, each with the ``request_id`` added, then
  ``{"type": "done", "request_id": ...}`` (``"cancelled": true`` after a cancel); a request
  that fails gets ``{"type": "error", "request_id": ..., "error": {OpenAI error}}`` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from server.auth import WEBSOCKET_SUBPROTOCOL, bearer_token, subprotocol_token
from server.errors import (
    GENERATION_ERRORS,
    INTERNAL_ERROR,
    APIError,
    engine_error,
    error_body,
    validation_error,
)
from server.handlers import prepare_chat, prepare_completion, stream_chunks
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.state import ServerState

log = logging.getLogger("specserve.requests")


class _Connection:
    def __init__(self, ws: WebSocket, state: ServerState):
        self.ws = ws
        self.state = state
        self.tasks: dict[str, asyncio.Task] = {}
        self.send_lock = asyncio.Lock()  # one frame at a time from concurrent requests

    async def send(self, message: dict) -> None:
        async with self.send_lock:
            await self.ws.send_text(json.dumps(message))

    async def error(self, request_id, status: int, message: str, param=None, code=None) -> None:
        body = error_body(status, message, param, code)
        await self.send({"type": "error", "request_id": request_id, **body})

    async def handle(self, message: dict) -> None:
        request_id = message.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            await self.error(
                request_id, 400, "request_id (a non-empty string) is required", "request_id"
            )
            return
        if message.get("type") == "cancel":
            task = self.tasks.get(request_id)
            if task is not None:
                task.cancel()
            return
        if request_id in self.tasks:
            await self.error(
                request_id, 400, f"request_id {request_id!r} is already in flight", "request_id"
            )
            return
        try:
            prepared = await self._prepare(message)
        except APIError as e:
            log.info("ws %s status=%d %s", request_id, e.status, e.message)
            await self.error(request_id, e.status, e.message, e.param)
            return
        except Exception:
            # A bug on this request: it fails alone; the connection and its others go on.
            log.exception("ws %s status=500 unexpected error", request_id)
            await self.error(request_id, 500, INTERNAL_ERROR)
            return
        task = asyncio.create_task(self._stream(request_id, prepared))
        self.tasks[request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(request_id, None))

    async def _prepare(self, message: dict):
        # Over a WebSocket every request streams (include_usage then applies as with SSE).
        body = {k: v for k, v in message.items() if k not in ("request_id", "type")}
        if body.get("stream", True) is not True:
            # Silently streaming anyway would answer something other than what was asked.
            raise APIError(
                400, "stream: requests over a WebSocket always stream; leave stream out or "
                "set it to true", "stream",
            )  # fmt: skip
        body["stream"] = True
        try:
            if "messages" in body:
                return await prepare_chat(self.state, ChatCompletionRequest.model_validate(body))
            if "prompt" in body:
                return await prepare_completion(self.state, CompletionRequest.model_validate(body))
        except ValidationError as e:
            raise validation_error(e) from None
        raise APIError(400, "a request needs `messages` (chat) or `prompt` (completions)")

    async def _stream(self, request_id: str, prepared) -> None:
        status, start = 200, time.perf_counter()
        try:
            async with contextlib.aclosing(stream_chunks(prepared)) as chunks:
                async for chunk in chunks:
                    await self.send({**chunk, "request_id": request_id})
            await self.send({"type": "done", "request_id": request_id})
        except asyncio.CancelledError:
            status = 499
            # Leaving stream_chunks aborted the engine request; tell the client it ended.
            with contextlib.suppress(Exception):
                await self.send({"type": "done", "request_id": request_id, "cancelled": True})
        except GENERATION_ERRORS as e:
            err = engine_error(e)
            status = err.status
            await self.error(request_id, err.status, err.message, err.param, err.code)
        except Exception:
            status = 500
            log.exception("ws %s stream failed", request_id)
            with contextlib.suppress(Exception):
                await self.error(request_id, 500, INTERNAL_ERROR)
        finally:
            usage = prepared.run.usage
            log.info(
                "ws %s %s status=%d finished_reason=%s prompt_tokens=%d completion_tokens=%d "
                "latency=%.3fs",
                request_id,
                prepared.response_id,
                status,
                prepared.run.endings(),
                usage.prompt_tokens,
                usage.completion_tokens,
                time.perf_counter() - start,
            )

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


def install_websocket(app: FastAPI, state: ServerState) -> None:
    @app.websocket("/v1/ws")
    async def websocket_endpoint(ws: WebSocket):
        if not state.settings.cors.origin_allowed(ws.headers.get("origin")):
            # Browsers let any page open a WebSocket anywhere; the allowed origins that CORS
            # applies to fetch() apply here by this check (a close before accepting is a 403).
            log.info("ws refused: origin %s is not allowed", ws.headers.get("origin"))
            await ws.close(code=1008)
            return
        # The Authorization header, or (browsers) the key offered as a subprotocol.
        offered = ws.scope.get("subprotocols") or []
        token = bearer_token(ws.headers.get("authorization")) or subprotocol_token(offered)
        chosen = WEBSOCKET_SUBPROTOCOL if WEBSOCKET_SUBPROTOCOL in offered else None
        await ws.accept(subprotocol=chosen)  # never the key's own subprotocol
        try:
            state.check_api_key(token)
        except APIError as e:
            await ws.send_text(json.dumps({"type": "error", **error_body(401, e.message)}))
            await ws.close(code=1008)
            return
        conn = _Connection(ws, state)
        try:
            while True:
                raw = await ws.receive_text()
                try:
                    message = json.loads(raw)
                    if not isinstance(message, dict):
                        raise ValueError("not an object")
                except ValueError:
                    await conn.error(None, 400, "each message must be a JSON object")
                    continue
                await conn.handle(message)
        except WebSocketDisconnect:
            pass
        finally:
            await conn.close()  # a disconnect aborts everything still in flight
