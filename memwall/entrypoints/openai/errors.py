"""Every failure leaves the server in OpenAI's error shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

User mistakes (bad JSON, wrong types, values out of range, a prompt longer than the context) are
400s, never FastAPI's default 422 body and never a 500. ``api_error_from`` maps exceptions from
anywhere below (SamplingParams, the processor, the tokenizer, the async engine) to one APIError,
so that the same mapping serves plain responses and errors sent mid-stream as an SSE event.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from memwall.engine.async_engine import EngineClosedError, EngineDeadError
from memwall.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("memwall.server")

# HTTP status -> OpenAI error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    @property
    def body(self) -> ErrorResponse:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param,
                                             code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def api_error_from(exc: BaseException) -> APIError:
    """The APIError a client should see for an exception raised while serving its request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc), code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), code="engine_dead")
    if isinstance(exc, (ValueError, OverflowError)):  # InvalidRequestError, TokenizerError, params
        return APIError(400, str(exc), getattr(exc, "param", None), getattr(exc, "code", None))
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__}); see the server log")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming each bad field, e.g. "n: Input should be less than or equal to 128"."""
    by_field: dict[str, list[tuple[list[str], dict]]] = {}
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            detail = error.get("ctx", {}).get("error", "")
            return f"the request body is not valid JSON ({detail})".replace(" ()", ""), None
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        by_field.setdefault(loc[0] if loc else "body", []).append((loc, error))
    parts = [_field_message(name, errors) for name, errors in list(by_field.items())[:5]]
    first = next(iter(by_field), None)
    return "; ".join(parts) or "invalid request", None if first == "body" else first


def _field_message(name: str, errors: list[tuple[list[str], dict]]) -> str:
    branches = [loc[1] for loc, _ in errors if len(loc) > 1]
    if len(errors) > 1 and len(set(branches)) == len(errors) and not any(b.isdigit() for b in branches):
        # One error per member of a union (e.g. prompt: str | list[int] | ...): name the choices.
        return f"{name}: expected one of {', '.join(branches)}"
    loc, error = errors[0]
    return f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid value')}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        return APIError(exc.status_code, str(exc.detail), headers=headers).response()

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def on_known_error(request: Request, exc: Exception) -> JSONResponse:
        return api_error_from(exc).response()

    # Registered by class (not only as the catch-all `Exception`, which Starlette re-raises after
    # answering) so that a user error is answered quietly, without a traceback in the log.
    for kind in (ValueError, OverflowError, EngineClosedError, EngineDeadError, Exception):
        app.add_exception_handler(kind, on_known_error)
