"""The gateway's OpenAI-compatible HTTP API: the FastAPI app, its auth, and the small endpoints.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize`` (all behind the API key when one is set: ``_RequireApiKey``)
and ``GET /health`` (open, like gRPC health). ``GET /metrics`` (open) is added by
``add_metrics_route`` when the gateway has metrics.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.request_limits import check_count
from pagedserve.services.common.auth import canonical_authorization
from pagedserve.services.common.grpc_server import CLIENT_API_MAX_MESSAGE_BYTES
from pagedserve.services.gateway.openai_chat import chat_prompt_mode, create_chat_completion, encode_messages
from pagedserve.services.gateway.openai_completions import create_completion
from pagedserve.services.gateway.generation_errors import StatusKind
from pagedserve.services.gateway.openai_errors import add_error_handlers, error_response, http_status
from pagedserve.services.gateway.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                         TokenizeRequest)
from pagedserve.services.gateway.openai_responses import (DetokenizeResponse, ModelCard, ModelList, TokenizeResponse,
                                                          now_s)
from pagedserve.services.gateway.openai_serving import OpenAIServing, invalid
from pagedserve.text.tokenizer import PromptTokenizer


HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
OPEN_PATHS = frozenset({HEALTH_PATH, METRICS_PATH})
"""Paths answered without the API key (probes and scrapers hold none)."""


class HealthState:
    """Whether the gateway serves (scheduler stream up, a worker up, Redis answering); the
    gateway's health watcher sets ``serving`` every second, ``GET /health`` reads it."""

    def __init__(self) -> None:
        self.serving = False


@dataclass(frozen=True)
class HttpSettings:
    """What the app needs besides the serving parts.

    Attributes:
        api_key: when not empty, clients must send ``Authorization: Bearer API_KEY``.
        max_body_bytes: larger request bodies are refused with 413.
        body_timeout_s: a request body must arrive whole within this many seconds (else 408), so
            that clients sending slowly cannot hold connections open.
    """

    api_key: str = ""
    max_body_bytes: int = CLIENT_API_MAX_MESSAGE_BYTES
    body_timeout_s: float = 30.0


CLOSE = {"Connection": "close"}
"""Headers of an answer given before the body was read: the connection closes after it (a client still
trickling its body kept the connection open for as long as it sent, and its unread bytes would be
taken for the next request)."""


class _BodyLimit:
    """ASGI middleware: reads each request body before the app does, answering 413 when it is over
    ``max_bytes`` (announced or counted: a chunked body has no length header) and 408 when it does
    not arrive whole within ``timeout_s``; the app then gets the body in one message."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self._app = app
        self._max = max_bytes
        self._timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self._max):
            return await self._too_large(scope, receive, send)
        try:
            async with asyncio.timeout(self._timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            response = error_response(408, f"the request body did not arrive within {self._timeout_s:g} s",
                                      headers=CLOSE)
            return await response(scope, receive, send)
        if body is None:
            return await self._too_large(scope, receive, send)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # afterwards: disconnect notices
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self._app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None when it grows past ``max_bytes`` (or the client left)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # the client went away: the app will notice
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max:
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"the request body exceeds {self._max} bytes (or its length is invalid)",
                                  headers=CLOSE)
        await response(scope, receive, send)


class _RequireApiKey:
    """ASGI middleware: answers 401 to a request for any path but ``OPEN_PATHS`` that lacks exactly one
    ``Authorization: Bearer API_KEY`` header (compared in constant time), before anything reads its
    body: a client without the key learns nothing of what its body would have got (400, 413, ...)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self._app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            values = [value for name, value in scope["headers"] if name == b"authorization"]
            if not (len(values) == 1 and hmac.compare_digest(canonical_authorization(values[0]), self._expected)):
                response = error_response(http_status(StatusKind.UNAUTHENTICATED),
                                          "missing or wrong API key (header Authorization: Bearer KEY)", headers=CLOSE)
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)


def _tokenize(tokenizer: PromptTokenizer, body: TokenizeRequest) -> list[int]:
    """Raises InvalidRequestError as the chat and completions endpoints do."""
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("prompt", "exactly one of prompt and messages must be set")
    if body.messages is not None:
        mode = chat_prompt_mode(body.add_generation_prompt, body.continue_final_message)
        return encode_messages(tokenizer, body.messages, mode)
    if body.add_special_tokens:
        return tokenizer.encode_prompt(body.prompt)
    return tokenizer.encode_prompt_without_special_tokens(body.prompt)


def _api_routes(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()
    tokenizer = serving.tokenizer

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(serving, body, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(serving, body, request)

    @router.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=serving.model_name, created=now_s(), max_model_len=tokenizer.info.max_model_len)
        return ModelList(data=[card])

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        """One model (the openai client's ``models.retrieve``); 404 for any other name."""
        serving.check_model(model)
        return ModelCard(id=serving.model_name, created=now_s(), max_model_len=tokenizer.info.max_model_len)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        if body.model is not None:
            serving.check_model(body.model)
        try:
            ids = await asyncio.to_thread(_tokenize, tokenizer, body)
        except InvalidRequestError as exc:
            raise invalid(exc) from exc
        return TokenizeResponse(count=len(ids), max_model_len=tokenizer.info.max_model_len, tokens=ids)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        if body.model is not None:
            serving.check_model(body.model)
        check_count("tokens", len(body.tokens), tokenizer.info.max_model_len, "token ids")  # a context at most
        ids = tokenizer.check_vocabulary(body.tokens, "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, ids, False))

    return router


def build_http_app(serving: OpenAIServing, health: HealthState, settings: HttpSettings) -> FastAPI:
    """The FastAPI app of the OpenAI-compatible API (add ``/metrics`` with ``add_metrics_route``)."""
    app = FastAPI(title="pagedserve", summary="OpenAI-compatible API of a pagedserve gateway",
                  docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    app.include_router(_api_routes(serving))

    @app.api_route(HEALTH_PATH, methods=["GET", "HEAD"])  # load balancers often probe with HEAD
    async def health_check() -> Response:
        return Response(status_code=200 if health.serving else 503)

    app.add_middleware(_BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    if settings.api_key:  # added last, so outermost: before the body limit reads the body
        app.add_middleware(_RequireApiKey, api_key=settings.api_key)
    return app


def add_metrics_route(app: FastAPI, render) -> None:
    """``GET /metrics`` (open): ``await render()`` returns ``(body bytes, content type)`` of the
    Prometheus exposition."""

    @app.get(METRICS_PATH)
    async def metrics() -> Response:
        body, content_type = await render()
        return Response(body, media_type=content_type)
