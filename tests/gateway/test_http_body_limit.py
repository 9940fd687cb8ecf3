"""The HTTP API's body limits, on the ASGI middleware itself: size (announced or counted) and time; and
through the gateway's uvicorn server on a real socket, that the connection closes after a 408."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

from pagedserve.services.gateway.http_app import _BodyLimit
from pagedserve.services.gateway.http_server import listening_socket, new_http_server


async def _echo(scope, receive, send) -> None:
    """An app that answers 200 with the body it received."""
    message = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": message["body"]})


def _run(messages, headers=(), max_bytes=10, timeout_s=1.0, delay_s=0.0) -> tuple[int, bytes]:
    return _run_with_headers(messages, headers, max_bytes, timeout_s, delay_s)[:2]


def _run_with_headers(messages, headers=(), max_bytes=10, timeout_s=1.0, delay_s=0.0) -> tuple[int, bytes, dict]:
    sent = []

    async def receive():
        if delay_s:
            await asyncio.sleep(delay_s)
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": list(headers)}
    asyncio.run(_BodyLimit(_echo, max_bytes, timeout_s)(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body, dict(start["headers"])


def _chunk(data: bytes, more: bool) -> dict:
    return {"type": "http.request", "body": data, "more_body": more}


def test_a_chunked_body_reaches_the_app_whole():
    assert _run([_chunk(b"abc", True), _chunk(b"def", False)]) == (200, b"abcdef")


def test_a_chunked_body_past_the_limit_is_413():
    status, body = _run([_chunk(b"x" * 6, True), _chunk(b"x" * 6, False)])
    assert status == 413 and json.loads(body)["error"]["code"] == 413


def test_an_announced_length_past_the_limit_is_413_unread():
    assert _run([], headers=[(b"content-length", b"11")])[0] == 413


def test_a_body_that_arrives_too_slowly_is_408():
    """Review finding: 300 connections sending a few bytes of their body stayed open for good."""
    status, body = _run([_chunk(b"ab", True), _chunk(b"cd", False)], timeout_s=0.1, delay_s=0.08)
    assert status == 408 and "did not arrive" in json.loads(body)["error"]["message"]


def test_answers_before_the_body_was_read_close_the_connection():
    assert _run_with_headers([], headers=[(b"content-length", b"11")])[2][b"connection"] == b"close"
    late = _run_with_headers([_chunk(b"ab", True), _chunk(b"cd", False)], timeout_s=0.1, delay_s=0.08)
    assert late[0] == 408 and late[2][b"connection"] == b"close"


def test_a_client_still_trickling_its_body_after_the_408_is_disconnected():
    """Attack pass 3: the 408 came at 30 s, and the connection stayed open for as long as the client sent
    one byte a second (a 16 MiB body: weeks)."""
    sock = listening_socket("127.0.0.1", 0)
    server = new_http_server(_BodyLimit(_echo, 1000, 0.5), header_timeout_s=5, send_timeout_s=5, close_s=1, tls={})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    client = socket.create_connection(sock.getsockname()[:2])
    try:
        client.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\n\r\n")
        client.settimeout(0.2)
        received, closed_at, start = b"", None, time.monotonic()
        while closed_at is None and time.monotonic() - start < 10:
            try:
                client.sendall(b"x")
                chunk = client.recv(1 << 16)
                received += chunk
                closed_at = time.monotonic() if not chunk else None
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
    finally:
        client.close()
        server.should_exit = True
        thread.join(10)
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert closed_at is not None and closed_at - start < 3, "the connection stayed open after the 408"
