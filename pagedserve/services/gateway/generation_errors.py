"""Why the gateway cannot serve a request: ``StatusKind`` (gRPC's canonical codes), the engine's
error kinds mapped onto it, and ``GenerationError``, which both front ends translate into their
transport's status."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from typing import TypeVar

from pagedserve.engine.request_errors import ErrorKind

_T = TypeVar("_T")


class StatusKind(enum.Enum):
    """Why a request failed; the values are the canonical status codes gRPC uses."""

    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


STATUS_OF_ERROR = {
    ErrorKind.INVALID_ARGUMENT: StatusKind.INVALID_ARGUMENT,
    # larger than any worker's KV cache: waiting cannot fix it, so not RESOURCE_EXHAUSTED (HTTP 429, which
    # clients retry) but FAILED_PRECONDITION (HTTP 400): it fits only once the operator gives workers more KV
    ErrorKind.RESOURCE_EXHAUSTED: StatusKind.FAILED_PRECONDITION,
    ErrorKind.UNAVAILABLE: StatusKind.UNAVAILABLE,
}
"""The gateway's status for each kind of engine error (HTTP maps ``StatusKind`` on in ``openai_errors``)."""


class GenerationError(Exception):
    """A request the gateway cannot serve (or stopped serving).

    Args:
        kind: what went wrong, mapped to a transport status by each front end.
        message: for the client; for ``INVALID_ARGUMENT`` it starts with the field name.
        param: the offending request field, when one is to blame ("" otherwise).
    """

    def __init__(self, kind: StatusKind, message: str, param: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param


async def naming_failures(events: AsyncIterator[_T], field: str) -> AsyncIterator[_T]:
    """``events``, where a request the engine ended with ``INVALID_ARGUMENT`` naming no field (its
    structured output's grammar did not build on the workers, or failed at a parser limit while
    decoding: ``limits.grammar_failure``) is named as ``field``, the client's field that asked for
    the structure ("": left as it is).

    Raises:
        GenerationError: those of ``events``; that one with ``param`` ``field``, its message prefixed.
    """
    try:
        async for event in events:
            yield event
    except GenerationError as exc:
        if not field or exc.kind is not StatusKind.INVALID_ARGUMENT or exc.param:
            raise
        raise GenerationError(exc.kind, f"{field}: {exc.message}", field) from exc
    finally:
        await events.aclose()
