"""The HTTP API's key check, on the ASGI middleware itself: it answers before anything reads the body."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedserve.services.gateway.http_app import OPEN_PATHS, _RequireApiKey

KEY = "k" * 32


def _run(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict | None, bool]:
    """(status, JSON body of a refusal, whether the app was called) for a POST of a malformed body."""
    sent, reached = [], []

    async def app(scope, receive, send) -> None:
        reached.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"{not json", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(_RequireApiKey(app, KEY)(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body) if status == 401 else None, bool(reached)


@pytest.mark.parametrize("headers", [[], [(b"authorization", b"Bearer wrong")],
                                     [(b"authorization", f"Bearer {KEY}".encode())] * 2])
def test_a_request_without_exactly_the_key_is_401_before_its_body_is_read(headers):
    """Review finding: malformed JSON without the key got 400 (the body was parsed first)."""
    status, body, reached = _run("/v1/completions", headers)
    assert (status, body["error"]["code"], body["error"]["type"], reached) == (401, 401, "authentication_error", False)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_key_lets_the_request_through_whatever_the_scheme_s_case(scheme):
    """Review 68: `bearer KEY` got 401; authentication schemes are case-insensitive (RFC 9110, 11.1)."""
    assert _run("/v1/completions", [(b"authorization", f"{scheme} {KEY}".encode())]) == (200, None, True)


@pytest.mark.parametrize("value", [f"Bearerx {KEY}", f"Basic {KEY}", KEY, f"Bearer {KEY.upper()}"])
def test_another_scheme_or_a_key_in_another_case_is_401(value):
    assert _run("/v1/completions", [(b"authorization", value.encode())])[0] == 401


def test_the_grpc_key_check_takes_the_scheme_in_any_case_and_the_key_as_it_is():
    from pagedserve.services.common.auth import API_KEY_KEY, _Check

    check = _Check(API_KEY_KEY, f"Bearer {KEY}")
    assert check.allows("/pagedserve.v1.Generation/Generate", [(API_KEY_KEY, f"bearer {KEY}")])
    assert not check.allows("/pagedserve.v1.Generation/Generate", [(API_KEY_KEY, f"bearer {KEY.upper()}")])


@pytest.mark.parametrize("path", sorted(OPEN_PATHS))
def test_probes_and_scrapers_need_no_key(path):
    assert _run(path, []) == (200, None, True)


def test_unknown_paths_are_behind_the_key_too():
    assert _run("/v1/embeddings", [])[0] == 401


def test_a_401_closes_the_connection():
    """Review finding: answered before the body was read, a 401 kept the connection open for as long as
    a client without the key trickled its body (as the 408 did)."""
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(_RequireApiKey(None, KEY)(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 401 and dict(start["headers"])[b"connection"] == b"close"
