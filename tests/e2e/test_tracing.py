"""One trace per request spans gateway -> scheduler -> worker (context in gRPC metadata and Redis)."""

from __future__ import annotations

import secrets

import grpc
import pytest

from pagedserve.services.common.pb import generate_pb2_grpc
from tests.e2e.processes import wait_until
from tests.e2e.test_stack import QUESTIONS, chat_request

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_one_trace_spans_gateway_scheduler_and_worker(stack):
    trace_id = secrets.token_hex(16)
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    with grpc.insecure_channel(stack.gateway) as channel:
        responses = list(generate_pb2_grpc.GenerationStub(channel).Generate(
            chat_request(QUESTIONS[1], max_tokens=4), metadata=(("traceparent", traceparent),), timeout=120))
    assert responses[-1].finish_reason

    def logged_by(*names: str) -> bool:
        return all(f'"trace_id": "0x{trace_id}"' in stack.processes[n].log_text() for n in names)

    wait_until(lambda: logged_by("gateway", "scheduler"), "gateway and scheduler spans", 20)
    wait_until(lambda: logged_by("worker-0") or logged_by("worker-1"), "a worker span", 20)
    for name, span in (("gateway", "gateway.Generate"), ("scheduler", "scheduler.request")):
        assert f'"name": "{span}"' in stack.processes[name].log_text()
