"""Who may call a pagedserve service: the gateway's API key and the cluster token between services.

Both travel as gRPC metadata and are checked by a server interceptor in constant time:

- clients of the gateway send ``authorization: Bearer KEY`` when the gateway has an API key;
- the gateway, the scheduler and the CLI tools send ``x-pagedserve-cluster-token: TOKEN`` to the
  Scheduler and Worker services, which refuse every call without it.

Health checks and server reflection stay open (probes and tools need no secret). A refused call
ends with ``UNAUTHENTICATED``.
"""

from __future__ import annotations

import collections
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pagedserve.services.common.grpc_server import INTERNAL_CHANNEL_OPTIONS
from pagedserve.options import Secret, option

CLUSTER_TOKEN_KEY = "x-pagedserve-cluster-token"
"""Metadata key of the cluster token."""

API_KEY_KEY = "authorization"
"""Metadata key of the gateway's API key (value ``Bearer KEY``)."""

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                        "/grpc.reflection.v1.ServerReflection/")
"""Methods callable without a secret."""

MISSING_CLUSTER_TOKEN = (
    "no cluster token: set --cluster-token-file, --cluster-token or PAGEDSERVE_CLUSTER_TOKEN to one secret "
    "shared by the scheduler, every worker and every gateway (make one with `openssl rand -hex 32`; "
    "`pagedserve up` and docker-compose.yml set it up for you)"
)


def read_secret(value: str, path: str, what: str) -> str:
    """The secret in the file ``path`` (surrounding whitespace stripped) when given, else ``value``.

    Raises:
        OSError: the file cannot be read.
        ValueError: the secret is not printable ASCII without spaces (gRPC metadata cannot carry it),
            or the file is empty.
    """
    if path:
        value = Path(path).read_text().strip()
        if not value:
            raise ValueError(f"{what} file {path} is empty")
    if value and not (value.isascii() and value.isprintable() and " " not in value):
        raise ValueError(f"{what} must be printable ASCII without spaces")
    return value


def cluster_token_option(when_missing: str = "required") -> Any:
    """The ``cluster_token`` field of a config: ``--cluster-token`` (env PAGEDSERVE_CLUSTER_TOKEN) and
    ``--cluster-token-file``; never shown in ``--help``. ``when_missing`` says what happens without one."""
    return option(f"secret shared by the scheduler, workers and gateways ({when_missing}); on the command line it is "
                  "visible in `ps`, prefer the file or the variable", "", repr=False, env="PAGEDSERVE_CLUSTER_TOKEN",
                  secret=Secret(read_cluster_token, "the cluster token"))


def api_key_option() -> Any:
    """The ``api_key`` field of a config: ``--api-key`` (env PAGEDSERVE_API_KEY) and ``--api-key-file``."""
    return option("clients must send `authorization: Bearer KEY` (default: no key); on the command line it is "
                  "visible in `ps`, prefer the file or the variable", "", repr=False, env="PAGEDSERVE_API_KEY",
                  secret=Secret(lambda value, path: read_secret(value, path, "the API key"), "the API key"))


MIN_CLUSTER_TOKEN_CHARS = 16
"""A shorter cluster token is refused: it would be guessable."""


def read_cluster_token(value: str, path: str) -> str:
    """The cluster token in the file ``path`` when given, else ``value`` ("" when none).

    Raises:
        ValueError: a token shorter than ``MIN_CLUSTER_TOKEN_CHARS`` (and as ``read_secret``).
    """
    token = read_secret(value, path, "the cluster token")
    if token and len(token) < MIN_CLUSTER_TOKEN_CHARS:
        raise ValueError(f"the cluster token has {len(token)} characters, fewer than {MIN_CLUSTER_TOKEN_CHARS}; "
                         "make one with `openssl rand -hex 32`")
    return token


def cluster_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata that authenticates a call to the Scheduler or Worker service."""
    return ((CLUSTER_TOKEN_KEY, token),)


def bearer_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    """Metadata that authenticates a call to a gateway with an API key (none when ``api_key`` is "")."""
    return ((API_KEY_KEY, f"Bearer {api_key}"),) if api_key else ()


def canonical_authorization(value: bytes) -> bytes:
    """``value`` with a leading ``bearer`` scheme, in any case, spelled ``Bearer``: authentication schemes are
    case-insensitive (RFC 9110, 11.1), and clients send ``bearer KEY`` too."""
    scheme, space, credentials = value.partition(b" ")
    return b"Bearer " + credentials if space and scheme.lower() == b"bearer" else value


class _Check:
    """Whether a call may proceed: an open method, or metadata ``key`` equal to ``expected``."""

    def __init__(self, key: str, expected: str) -> None:
        if not expected:
            raise ValueError("an empty secret would let every caller in")
        self.key = key
        self._expected = expected.encode()

    def allows(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        if method.startswith(OPEN_METHOD_PREFIXES):
            return True
        values = [v for k, v in (metadata or ()) if k == self.key and isinstance(v, str)]
        return len(values) == 1 and hmac.compare_digest(canonical_authorization(values[0].encode()), self._expected)


def _refusing_handler(handler: grpc.RpcMethodHandler, refuse) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` whose behaviour is ``refuse``."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class MetadataAuthInterceptor(grpc.ServerInterceptor):
    """For a thread-pool server: every method but health and reflection needs ``key: expected``.

    Args:
        key: metadata key, e.g. ``CLUSTER_TOKEN_KEY``.
        expected: the whole value the caller must send (compared in constant time).
        what: named in the UNAUTHENTICATED message, e.g. "cluster token".

    Raises:
        ValueError: ``expected`` is empty.
    """

    def __init__(self, key: str, expected: str, what: str) -> None:
        self._check = _Check(key, expected)
        self._message = f"missing or wrong {what} (metadata {key})"

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or self._check.allows(handler_call_details.method, handler_call_details.invocation_metadata):
            return handler

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self._message)

        return _refusing_handler(handler, refuse)


class AioMetadataAuthInterceptor(grpc.aio.ServerInterceptor):
    """``MetadataAuthInterceptor`` for an asyncio server (same arguments)."""

    def __init__(self, key: str, expected: str, what: str) -> None:
        self._check = _Check(key, expected)
        self._message = f"missing or wrong {what} (metadata {key})"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or self._check.allows(handler_call_details.method, handler_call_details.invocation_metadata):
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._message)

        return _refusing_handler(handler, refuse)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    pass


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata to every unary-request call of a thread-based channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details.method, details.timeout, (*(details.metadata or ()), *self._metadata),
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _AioMetadata:
    """Adds fixed metadata to the calls of an asyncio channel (one subclass per kind of call:
    grpc.aio files an interceptor under the first kind it implements only)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _AioUnaryUnaryMetadata(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioUnaryStreamMetadata(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def _aio_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    return [_AioUnaryUnaryMetadata(metadata), _AioUnaryStreamMetadata(metadata)]


def cluster_channel(target: str, token: str) -> grpc.Channel:
    """A channel to a Scheduler or Worker service at ``target`` whose calls carry ``token``."""
    channel = grpc.insecure_channel(target, options=INTERNAL_CHANNEL_OPTIONS)
    return grpc.intercept_channel(channel, _AddMetadata(cluster_metadata(token)))


def cluster_aio_channel(target: str, token: str) -> grpc.aio.Channel:
    """``cluster_channel`` for asyncio code."""
    return grpc.aio.insecure_channel(target, options=INTERNAL_CHANNEL_OPTIONS,
                                     interceptors=_aio_interceptors(cluster_metadata(token)))


def gateway_aio_interceptors(api_key: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that send ``api_key`` to a gateway (none when ``api_key`` is "")."""
    return _aio_interceptors(bearer_metadata(api_key)) if api_key else []


@dataclass(frozen=True)
class ClusterAuth:
    """The cluster token alone, for a command that needs nothing else of a service's config
    (``pagedserve worker-rank``).

    Raises:
        ValueError: no cluster token.
    """

    cluster_token: str = cluster_token_option()

    def __post_init__(self) -> None:
        if not self.cluster_token:
            raise ValueError(MISSING_CLUSTER_TOKEN)
