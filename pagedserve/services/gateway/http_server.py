"""The HTTP server of the OpenAI-compatible API: uvicorn on the gateway's event loop, speaking h11,
with a deadline on request headers.

uvicorn times out a keep-alive connection only after a complete response (``timeout_keep_alive``):
a client that opens a connection and sends part of a request line or of its headers, then nothing,
holds the connection for ever (slowloris). ``HeaderTimeoutProtocol`` closes such a connection once
``header_timeout_s`` passed without complete headers, as nginx's ``client_header_timeout`` does. The
body has its own bound (``http_app.HttpSettings.body_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("pagedserve.gateway")

BACKLOG = 2048
"""Connections the kernel queues before the server accepts them (uvicorn's default; Linux caps it at
``net.core.somaxconn``): a burst of new clients waits there instead of being refused."""

KEEP_ALIVE_S = 30
"""An idle keep-alive connection is closed after this many seconds without a new request."""


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete within
    ``header_timeout_s`` seconds of the connection opening or of the first byte of a following
    request (on a kept-alive connection), and aborting one whose client has not read for
    ``send_timeout_s`` seconds while the server had more to send (its write buffer full: a closed
    transport would wait for ever to flush it).

    Args:
        header_timeout_s: the first bound, seconds (positive).
        send_timeout_s: the second bound, seconds (positive; ``--send-timeout-s``).
        *args, **kwargs: those of ``H11Protocol`` (uvicorn passes them).
    """

    def __init__(self, *args, header_timeout_s: float, send_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_deadline: asyncio.TimerHandle | None = None
        self._send_timeout_s = send_timeout_s
        self._send_deadline: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_deadline is None:
            self._send_deadline = self.loop.call_later(self._send_timeout_s, self._on_send_timeout)

    def resume_writing(self) -> None:
        self._disarm_send_deadline()
        super().resume_writing()

    def _disarm_send_deadline(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _on_send_timeout(self) -> None:
        self._send_deadline = None
        log.info("aborting the HTTP connection of %s: it read nothing for %g s",
                 "%s:%d" % self.client if self.client else "a client", self._send_timeout_s)
        self.transport.abort()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and self._awaiting_headers():  # a following request begins
            self._arm_header_deadline()
        super().data_received(data)
        if not self._awaiting_headers():
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._awaiting_headers() and self.conn.trailing_data[0]:  # part of a pipelined request waits
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        self._disarm_send_deadline()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        """Whether the client has yet to send the current request's complete headers."""
        return self.conn.their_state is h11.IDLE

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self._header_timeout_s, self._on_header_timeout)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _on_header_timeout(self) -> None:
        self._header_deadline = None
        if self._awaiting_headers() and not self.transport.is_closing():
            log.info("closing the HTTP connection of %s: no complete request headers within %g s",
                     "%s:%d" % self.client if self.client else "a client", self._header_timeout_s)
            self.transport.close()


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside the gateway's event loop: the gateway handles the signals, not uvicorn."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one) with room for ``BACKLOG``
    connections not yet accepted.

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family, backlog=BACKLOG)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port} (--http-port): {exc.strerror or exc}") from exc


def new_http_server(app, header_timeout_s: float, send_timeout_s: float, close_s: float,
                    tls: dict[str, str]) -> EmbeddedUvicorn:
    """uvicorn serving ``app`` with ``HeaderTimeoutProtocol`` (always h11: not httptools even when
    installed), no connection limit of its own (the gateway bounds requests in flight), and at most
    ``close_s`` seconds for the responses still open when it stops. ``tls``: uvicorn's
    ``ssl_certfile``/``ssl_keyfile`` settings, or empty for plaintext."""
    protocol = functools.partial(HeaderTimeoutProtocol, header_timeout_s=header_timeout_s,
                                 send_timeout_s=send_timeout_s)
    config = uvicorn.Config(app, http=protocol, lifespan="off", access_log=False, log_level="warning",
                            timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=close_s, **tls)
    return EmbeddedUvicorn(config)
