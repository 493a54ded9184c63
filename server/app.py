"""The FastAPI application: OpenAI routes, SSE streaming, health and metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from engine.core_process import EngineDeadError, EngineNotReadyError
from fastapi import Depends, FastAPI, Header
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from server.errors import APIError, error_body, install_error_handlers
from server.handlers import (
    Prepared,
    engine_failure,
    full_response,
    prepare_chat,
    prepare_completion,
    stream_chunks,
)
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.state import ServerSettings, ServerState
from server.websocket import install_websocket

log = logging.getLogger("specserve.requests")


def create_app(settings: ServerSettings) -> FastAPI:
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await state.start()
        yield
        await state.stop()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.specserve = state
    install_error_handlers(app)

    def authorized(authorization: str | None = Header(default=None)) -> None:
        state.check_api_key(authorization)

    @app.get("/health")
    async def health():
        if state.ready:
            return Response(status_code=200)
        return JSONResponse(error_body(503, "engine not ready"), status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "specserve",
            "root": settings.config.model,
        }
        if state.client.info is not None:
            card["max_model_len"] = state.client.info.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatCompletionRequest):
        return await respond(prepare_chat(state, body), stream=body.stream)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest):
        return await respond(prepare_completion(state, body), stream=body.stream)

    install_websocket(app, state)
    return app


async def respond(p: Prepared, stream: bool):
    """Everything that can fail on input has been checked: now start the response."""
    start = time.perf_counter()
    if stream:
        return EventSourceResponse(_sse(p, start), sep="\n", ping=15)
    status = 200
    try:
        return await full_response(p)
    except (EngineDeadError, EngineNotReadyError) as e:
        status = 503
        raise engine_failure(e) from None
    except ValueError as e:  # refused by the engine itself
        status = 400
        raise APIError(400, str(e)) from None
    finally:
        _log(p, status, start)


async def _sse(p: Prepared, start: float) -> AsyncIterator[dict]:
    status = 200
    try:
        async for chunk in stream_chunks(p):
            yield {"data": json.dumps(chunk)}
    except (EngineDeadError, EngineNotReadyError, ValueError) as e:
        # Headers are gone already: the error travels as an event, as vLLM does.
        status = 503 if not isinstance(e, ValueError) else 400
        yield {"data": json.dumps(error_body(status, str(e)))}
    except asyncio.CancelledError:
        status = 499  # the client went away; leaving the generator aborted the request
        raise
    finally:
        _log(p, status, start)
    yield {"data": "[DONE]"}


def _log(p: Prepared, status: int, start: float) -> None:
    usage = p.run.usage
    log.info(
        "%s status=%d prompt_tokens=%d completion_tokens=%d latency=%.3fs",
        p.response_id,
        status,
        usage.prompt_tokens,
        usage.completion_tokens,
        time.perf_counter() - start,
    )
