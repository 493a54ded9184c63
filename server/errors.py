"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause is raised as ``APIError`` (or is a pydantic validation
error) and answered before any streaming response starts.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core_protocol import (
    EngineDeadError,
    EngineNotReadyError,
    RequestTimeoutError,
    StreamBacklogError,
)
from server.shutdown import ShutdownDeadline

log = logging.getLogger("specserve.requests")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.code),
        status_code=err.status,
        headers=err.headers,
    )


def invalid_parameter(exc: ValueError) -> APIError:
    """A ValueError from SamplingParams or prompt checks; its message names the parameter."""
    message = str(exc)
    first_word = message.split(" ", 1)[0]
    param = first_word if first_word.isidentifier() else None
    return APIError(400, message, param=param, code="invalid_value")


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A malformed body: OpenAI answers 400 (not FastAPI's default 422), naming the field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        # FastAPI's loc is ("body", character offset): no parameter is at fault.
        return APIError(400, _json_message(first))  # param and code null, as OpenAI
    param = field_path(first.get("loc", ()))
    # Our own validators' messages come as "Value error, <message>": the message is enough.
    # A field of several types fails once per type: say what each would have needed.
    details = [
        str(e.get("msg", "invalid request")).removeprefix("Value error, ")
        for e in errors
        if field_path(e.get("loc", ())) == param
    ] or ["invalid request"]
    detail = " or ".join(dict.fromkeys(details))
    if tuple(first.get("loc", ())) == ("body",):  # absent, or JSON that is not an object
        if first.get("type") == "missing":
            return APIError(400, "the body is empty: a JSON object is expected")
        return APIError(400, f"the body must be a JSON object: {detail}")
    message = f"{param}: {detail}" if param else detail
    return APIError(400, message, param=param, code="invalid_value")


def field_path(loc) -> str | None:
    """A validation error's location as the request's field path ("messages.0.content"):
    pydantic also names the member of a union it tried ("str", "list[str]"), which is not a
    field."""
    parts = [str(p) for p in loc if p != "body" and not _is_type_tag(p)]
    return ".".join(parts) or None


def _is_type_tag(part) -> bool:
    if not isinstance(part, str):
        return False
    return "[" in part or part.startswith("function-") or part in _TYPE_NAMES


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _json_message(error: dict) -> str:
    position = error["loc"][-1] if len(error.get("loc", ())) > 1 else None
    reason = (error.get("ctx") or {}).get("error") or error.get("msg", "")
    where = f" at character {position}" if isinstance(position, int) else ""
    return f"the body is not valid JSON: {reason}{where}"


def engine_error(exc: Exception) -> APIError:
    """What a failure while generating becomes once the request was accepted."""
    if isinstance(exc, StreamBacklogError):
        return APIError(408, str(exc), code="client_too_slow")  # the client did not read
    if isinstance(exc, RequestTimeoutError):
        return APIError(408, str(exc), code="timeout")
    if isinstance(exc, ShutdownDeadline):
        return APIError(503, str(exc), code="server_shutdown")
    if isinstance(exc, (EngineDeadError, EngineNotReadyError)):
        return APIError(503, f"The engine failed while serving this request: {exc}")
    return APIError(400, str(exc))  # a ValueError: the engine refused the request


GENERATION_ERRORS = (
    ShutdownDeadline,
    EngineDeadError,
    EngineNotReadyError,
    StreamBacklogError,
    RequestTimeoutError,
    ValueError,
)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        log.info("%s %s status=%d %s", request.method, request.url.path, exc.status, exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return await _api_error(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail)))


class UnexpectedErrors:
    """ASGI middleware: a bug, not the client's input, answered in OpenAI's shape all the same
    and logged as the 500 it is. A middleware rather than an exception handler for
    ``Exception``, which Starlette runs outside every middleware: there the response would
    miss the CORS headers and a browser page would see "failed to fetch"."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("%s %s status=500 unexpected error", scope["method"], scope["path"])
            if started:
                raise
            await error_response(APIError(500, INTERNAL_ERROR))(scope, receive, send)


INTERNAL_ERROR = "The server had an error while processing your request."
