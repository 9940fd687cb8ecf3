"""OpenAI's error object, and the HTTP status of each way a request can fail.

Every error the HTTP API returns is ``{"error": {"message", "type", "param", "code"}}`` with
``code`` the HTTP status; bad input is 400 (never 422 nor 500).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.services.gateway.generation_errors import STATUS_OF_ERROR, GenerationError, StatusKind
from pagedserve.services.gateway.openai_responses import ErrorInfo, ErrorResponse
from pagedserve.services.gateway.openai_serving import ClientDisconnected

HTTP_STATUS = {
    StatusKind.INVALID_ARGUMENT: 400,
    StatusKind.OUT_OF_RANGE: 400,
    StatusKind.FAILED_PRECONDITION: 400,
    StatusKind.UNAUTHENTICATED: 401,
    StatusKind.PERMISSION_DENIED: 403,
    StatusKind.NOT_FOUND: 404,
    StatusKind.RESOURCE_EXHAUSTED: 429,
    StatusKind.UNIMPLEMENTED: 501,
    StatusKind.UNAVAILABLE: 503,
    StatusKind.ABORTED: 503,
    StatusKind.DEADLINE_EXCEEDED: 504,
}
"""HTTP status of each ``StatusKind`` (others: 500)."""

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
               413: "invalid_request_error",
               429: "rate_limit_error",
               503: "service_unavailable_error"}
"""OpenAI-style ``type`` of each status (others: ``internal_error``)."""


def http_status(kind: StatusKind) -> int:
    """The HTTP status a failure of ``kind`` is answered with."""
    return HTTP_STATUS.get(kind, 500)


def error_body(status: int, message: str, param: str = "") -> ErrorResponse:
    """OpenAI's error object for an HTTP status."""
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "internal_error"), param=param or None, code=status)
    return ErrorResponse(error=info)


def error_response(status: int, message: str, param: str = "", headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON error response."""
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status, headers=headers)


def error_event(exc: GenerationError) -> bytes:
    """The SSE event that reports a failure after a stream has started."""
    body = error_body(http_status(exc.kind), exc.message, exc.param)
    return b"data: " + body.model_dump_json().encode() + b"\n\n"


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param_of(loc: tuple) -> str:
    """``messages[0].content`` from pydantic's ``("body", "messages", 0, "content")``; the tags
    pydantic adds for union members (``constrained-str``, ``list[int]``) are left out."""
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif str(part).isidentifier() and str(part) not in _TYPE_TAGS:
            name += f".{part}" if name else str(part)
    return name


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # in a union (prompt: string or list...), "not a string" says less than "too long" of the member
    # the client meant: type mismatches go last
    errors = sorted(exc.errors(), key=lambda e: str(e.get("type", "")).endswith("_type"))
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    if first.get("type") == "json_invalid":  # its loc holds a character offset, not a parameter
        return error_response(400, f"the request body is not valid JSON: {first.get('msg', '')} at character "
                              f"{first.get('loc', ('', '?'))[-1]}")
    param = _param_of(tuple(first.get("loc", ())))
    if not param and not _json_content(request):  # FastAPI parses only a JSON body as an object
        return error_response(400, "send the body as a JSON object with the header Content-Type: application/json "
                                   f"(got Content-Type: {request.headers.get('content-type', 'none')})")
    message = f"{param or 'body'}: {first.get('msg', 'invalid')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return error_response(400, message, param)


def _json_content(request: Request) -> bool:
    """Whether the request says its body is JSON (``application/json``, or a ``+json`` type)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


async def _on_generation_error(request: Request, exc: GenerationError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.kind in (StatusKind.RESOURCE_EXHAUSTED, StatusKind.UNAVAILABLE) else None
    return error_response(http_status(exc.kind), exc.message, exc.param, headers)


async def _on_invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
    return error_response(http_status(STATUS_OF_ERROR[exc.kind]), str(exc), exc.field_name)


async def _on_client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
    """The client left before the answer (its request was aborted): nothing to send, nothing to log.
    499 is nginx's "client closed request"; no client reads it."""
    return Response(status_code=499)


async def _on_http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's own errors; a body it could not parse for another reason than bad JSON syntax (bytes that
    are not UTF-8, an integer of over 4,300 digits, nesting too deep) gets that reason after FastAPI's
    "There was an error parsing the body"."""
    detail = str(exc.detail)
    cause = exc.__cause__
    if exc.status_code == 400 and cause is not None:
        detail += f" ({type(cause).__name__}: {str(cause)[:200]})"
        detail += "; send the body as UTF-8" if isinstance(cause, UnicodeDecodeError) else ""
    return error_response(exc.status_code, detail, headers=getattr(exc, "headers", None))


def add_error_handlers(app: FastAPI) -> None:
    """Makes every error of ``app`` an OpenAI error object (pydantic validation errors are 400)."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(GenerationError, _on_generation_error)
    app.add_exception_handler(InvalidRequestError, _on_invalid_request)
    app.add_exception_handler(HTTPException, _on_http_exception)
    app.add_exception_handler(ClientDisconnected, _on_client_disconnected)
