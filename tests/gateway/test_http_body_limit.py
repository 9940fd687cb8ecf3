"""The HTTP API's body limits, on the ASGI middleware itself: size (announced or counted) and time."""

from __future__ import annotations

import asyncio
import json

from services.gateway.http_app import _BodyLimit


async def _echo(scope, receive, send) -> None:
    """An app that answers 200 with the body it received."""
    message = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": message["body"]})


def _run(messages, headers=(), max_bytes=10, timeout_s=1.0, delay_s=0.0) -> tuple[int, bytes]:
    sent = []

    async def receive():
        if delay_s:
            await asyncio.sleep(delay_s)
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": list(headers)}
    asyncio.run(_BodyLimit(_echo, max_bytes, timeout_s)(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


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
