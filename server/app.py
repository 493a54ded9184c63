"""The FastAPI application: OpenAI routes, SSE streaming, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from sse_starlette.sse import EventSourceResponse

from server.auth import bearer_token
from server.cors import install_cors
from server.errors import (
    GENERATION_ERRORS,
    INTERNAL_ERROR,
    APIError,
    UnexpectedErrors,
    engine_error,
    error_body,
    install_error_handlers,
)
from server.handlers import (
    Prepared,
    full_response,
    prepare_chat,
    prepare_completion,
    stream_chunks,
)
from server.limits import BodySizeLimit
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.state import ServerSettings, ServerState
from server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from server.websocket import install_websocket

log = logging.getLogger("specserve.requests")
PLAYGROUND = Path(__file__).parent / "static" / "playground.html"


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
    # Innermost first: CORS wraps everything, so even a 413 or a 500 carries its headers.
    app.add_middleware(UnexpectedErrors)
    app.add_middleware(BodySizeLimit, max_bytes=settings.limits.max_body_bytes)
    install_cors(app, settings.cors)

    def authorized(authorization: str | None = Header(default=None)) -> None:
        state.check_api_key(bearer_token(authorization))

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health():
        if state.ready:
            return Response(status_code=200)
        return JSONResponse(error_body(503, "engine not ready"), status_code=503)

    @app.get("/playground", include_in_schema=False)
    async def playground():
        return HTMLResponse(PLAYGROUND.read_text())

    @app.get("/", include_in_schema=False)
    async def home():
        return RedirectResponse("/playground")

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "specserve",
            "root": settings.config.model,
        }
        if state.client.info is not None:
            card["max_model_len"] = state.client.info.max_model_len
            card["decoders"] = list(state.client.info.decoders)  # for "speculative.method"
        return card

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def retrieve_model(model_id: str):
        if model_id != settings.model_name:
            raise APIError(
                404, f"The model `{model_id}` does not exist", param="model", code="model_not_found"
            )
        return model_card()

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(state, body)

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize_route(body: DetokenizeRequest):
        return await detokenize(state, body)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatCompletionRequest, request: Request):
        return await respond(await prepare_chat(state, body), body.stream, request)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        return await respond(await prepare_completion(state, body), body.stream, request)

    install_websocket(app, state)
    return app


def _version() -> str:

    try:
        return version("specserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


async def respond(p: Prepared, stream: bool, request: Request):
    """Everything that can fail on input has been checked: now start the response."""
    start = time.perf_counter()
    if stream:
        return EventSourceResponse(_sse(p, start), sep="\n", ping=15)
    status = 200
    work = asyncio.create_task(full_response(p))
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client left: stop generating for nobody
            status = 499
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=499)
        return work.result()
    except GENERATION_ERRORS as e:
        err = engine_error(e)
        status = err.status
        raise err from None
    finally:
        gone.cancel()
        _log(p, status, start)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (FastAPI does not cancel handlers)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(p: Prepared, start: float) -> AsyncIterator[dict]:
    status = 200
    try:
        async with contextlib.aclosing(stream_chunks(p)) as chunks:
            async for chunk in chunks:
                yield {"data": json.dumps(chunk)}
    except GENERATION_ERRORS as e:
        # Headers are gone already: the error travels as an event, as vLLM does (a stream
        # still open at the shutdown deadline ends this way too).
        err = engine_error(e)
        status = err.status
        yield {"data": json.dumps(error_body(err.status, err.message, err.param, err.code))}
    except asyncio.CancelledError:
        status = 499  # the client went away; leaving the generator aborted the request
        raise
    except Exception:
        # A bug: the stream still ends as streams end (an error event, then [DONE]), and the
        # log says 500, not the 200 its headers said.
        status = 500
        log.exception("%s stream failed", p.response_id)
        yield {"data": json.dumps(error_body(500, INTERNAL_ERROR))}
    finally:
        _log(p, status, start)
    yield {"data": "[DONE]"}


def _log(p: Prepared, status: int, start: float) -> None:
    usage = p.run.usage
    log.info(
        "%s status=%d finished_reason=%s prompt_tokens=%d completion_tokens=%d latency=%.3fs",
        p.response_id,
        status,
        p.run.endings(),
        usage.prompt_tokens,
        usage.completion_tokens,
        time.perf_counter() - start,
    )
