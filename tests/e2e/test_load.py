"""Load through the real stack: 256 concurrent greedy streams, each exactly its own text (issue #9)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.common.pb import generate_pb2_grpc
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request

pytestmark = [pytest.mark.e2e, pytest.mark.model]

COPIES = 16  # of each of the 16 questions: 256 streams at once


def test_256_concurrent_streams_with_shared_labels_get_exactly_their_own_tokens(stack, offline_outputs):
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        def one(i: int) -> tuple[str, list[int] | str]:
            question = QUESTIONS[i % len(QUESTIONS)]
            request = chat_request(question)
            request.request_id = f"label-{i % 4}"  # labels shared by 64 calls each
            try:
                return question, [t for r in stub.Generate(request, timeout=600) for t in r.token_ids]
            except grpc.RpcError as exc:
                return question, exc.code().name

        started = time.monotonic()
        with ThreadPoolExecutor(len(QUESTIONS) * COPIES) as pool:
            results = list(pool.map(one, range(len(QUESTIONS) * COPIES)))
        elapsed = time.monotonic() - started
    failures = [r for _, r in results if isinstance(r, str)]
    mixed = [q for q, r in results if not isinstance(r, str) and r != list(offline_outputs[q].token_ids)]
    print(f"\n{len(results)} concurrent streams in {elapsed:.1f} s: {len(failures)} failed, {len(mixed)} with "
          f"other tokens than their own")
    assert failures == [] and mixed == []
    assert_all_blocks_free(stack)
