"""Registers the Generation service so that undecodable request bytes get INVALID_ARGUMENT.

With the generated registration, gRPC decodes the request before the servicer runs, and bytes it
cannot decode (for instance a string field holding invalid UTF-8) end the call with a status that
names an internal exception. Here the method takes the raw bytes and decodes them itself.
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf.message import DecodeError

from pagedserve.services.common.pb import generate_pb2 as gen

SERVICE_NAME = gen.DESCRIPTOR.services_by_name["Generation"].full_name


class StalledCallErrors(logging.Filter):
    """Drops gRPC's ERROR traceback for a ``Generate`` call that ended without being able to send its
    status (a message its client left unread is still queued, or the client is gone): the servicer
    logs its own WARNING when it cuts such a call (``--send-timeout-s``), and a client that left needs
    no traceback. Installed on gRPC's ``grpc._cython.cygrpc`` logger by :func:`add_generation_service`."""

    PREFIX = f"ExecuteBatchError raised in core by servicer method [/{SERVICE_NAME}/Generate]"

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.PREFIX)


_STALLED_CALL_ERRORS = StalledCallErrors()


async def _decode(raw: bytes, context: grpc.aio.ServicerContext) -> gen.GenerateRequest:
    """The request message; aborts the call with INVALID_ARGUMENT when ``raw`` does not decode."""
    try:
        return gen.GenerateRequest.FromString(raw)
    except DecodeError:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request: {len(raw)} bytes that do not decode as a {gen.GenerateRequest.DESCRIPTOR.full_name} "
            "(string fields must hold valid UTF-8)",
        )
        raise  # not reached: abort raises


def add_generation_service(servicer, server: grpc.aio.Server) -> None:
    """Adds the Generation service, ``servicer.Generate`` behind a decoder that cannot fail the call.

    Args:
        servicer: has ``Generate(request, context)``, a coroutine that writes each ``GenerateResponse``
            with ``context.write`` (``pagedserve.services.gateway.service.GenerationServicer``).
        server: the asyncio gRPC server, not yet started.
    """

    async def generate(raw: bytes, context: grpc.aio.ServicerContext) -> None:
        await servicer.Generate(await _decode(raw, context), context)

    logging.getLogger("grpc._cython.cygrpc").addFilter(_STALLED_CALL_ERRORS)  # once: the same filter object
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=None, response_serializer=gen.GenerateResponse.SerializeToString
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
