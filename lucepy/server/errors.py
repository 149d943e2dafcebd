"""The one place where exception types become HTTP statuses and OpenAI error JSON.

``{"error": {"message", "type", "param", "code"}}``; the most specific class in the table wins.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lucepy.errors import (
    AuthError,
    ConfigError,
    ContextOverflow,
    GGMLError,
    LucepyError,
    ModelFileError,
    ModelUnavailable,
    WorkerError,
)

log = logging.getLogger(__name__)

# exception type -> (HTTP status, OpenAI error type, code)
STATUS: dict[type[BaseException], tuple[int, str, str | None]] = {
    ConfigError: (400, "invalid_request_error", None),
    ContextOverflow: (400, "invalid_request_error", "context_length_exceeded"),
    AuthError: (401, "authentication_error", "invalid_api_key"),
    ModelUnavailable: (503, "server_error", "model_unavailable"),
    GGMLError: (503, "server_error", "model_failed"),
    ModelFileError: (503, "server_error", "model_failed"),
    WorkerError: (503, "server_error", "model_failed"),
    LucepyError: (500, "server_error", None),
}
_INTERNAL = (500, "server_error", None)
_HTTP_TYPES = {401: "authentication_error", 404: "not_found_error"}


def classify(err: BaseException) -> tuple[int, str, str | None]:
    for cls in type(err).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return _INTERNAL


def error_body(message: str, etype: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def body_for(err: BaseException) -> tuple[int, dict]:
    """The status and JSON body for ``err``; an unexpected error hides its details."""
    status, etype, code = classify(err)
    if isinstance(err, LucepyError):
        message = str(err)
    else:
        log.error("unexpected error while serving a request", exc_info=err)
        message = f"internal error ({type(err).__name__}); the server log has the details"
    return status, error_body(message, etype, getattr(err, "param", None), code)


def response_for(err: BaseException) -> JSONResponse:
    status, body = body_for(err)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "invalid")
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)


def _http(_: Request, err: HTTPException) -> JSONResponse:
    etype = _HTTP_TYPES.get(err.status_code, "invalid_request_error")
    if err.status_code >= 500:
        etype = "server_error"
    return JSONResponse(error_body(str(err.detail), etype), status_code=err.status_code)


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(LucepyError, lambda _, err: response_for(err))
    app.add_exception_handler(Exception, lambda _, err: response_for(err))  # bugs: logged, 500
