"""End to end: real redis-server, real scheduler, two workers and a gateway, real gRPC."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb import generate_pb2_grpc
from tests.e2e.processes import scheduler_stats, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.model]

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
    "Give me a synonym for happy.",
    "Why is the sky blue? Answer briefly.",
    "List two fruits that are red.",
    "What does a compiler do?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a cat.",
    "What is photosynthesis, in one sentence?",
    "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?",
    "What is the opposite of cold?",
    "Describe a rainbow in five words.",
]


def chat_request(question: str, max_tokens: int = 24, **sampling) -> gen.GenerateRequest:
    request = gen.GenerateRequest(sampling_params=gen.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling))
    request.chat.messages.add(role="user", content=question)
    return request


def stream(target: str, request: gen.GenerateRequest) -> list[gen.GenerateResponse]:
    with grpc.insecure_channel(target) as channel:
        return list(generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300))


def assert_all_blocks_free(stack) -> None:
    def free() -> bool:
        stats = scheduler_stats(stack.scheduler)
        return stats.num_running == 0 and stats.num_waiting == 0 and all(
            w.num_free_blocks == w.num_blocks for w in stats.workers
        )

    wait_until(free, "every KV block free", 30)


def test_chat_completion_streams_in_chunks_and_matches_in_process(stack, offline_outputs):
    question = QUESTIONS[0]
    responses = stream(stack.gateway, chat_request(question))
    expected = offline_outputs[question]
    assert len([r for r in responses if r.text]) >= 3, "the text arrived in several chunks"
    assert all(not r.finish_reason for r in responses[:-1]) and responses[-1].finish_reason
    assert "".join(r.text for r in responses) == expected.text
    assert [t for r in responses for t in r.token_ids] == list(expected.token_ids)
    last = responses[-1]
    assert last.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert last.usage.completion_tokens == len(expected.token_ids)
    assert "Paris" in expected.text
    assert_all_blocks_free(stack)


def test_sixteen_concurrent_streams_complete_correctly(stack, offline_outputs):
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        results = list(pool.map(lambda q: stream(stack.gateway, chat_request(q)), QUESTIONS))
    for question, responses in zip(QUESTIONS, results):
        assert "".join(r.text for r in responses) == offline_outputs[question].text, question
        assert responses[-1].finish_reason in (gen.FINISH_REASON_STOP, gen.FINISH_REASON_LENGTH)
    stats = scheduler_stats(stack.scheduler)
    assert len(stats.workers) == 2
    assert_all_blocks_free(stack)



def test_a_scheduler_given_no_token_budget_gives_each_cpu_worker_the_cpu_one(stack):
    """Each worker registers its device and plans within that device's budget (256 on a CPU): a scheduler
    started alone, as the README shows, gave CPU workers the GPU's 2048 (review 69)."""
    assert [w.token_budget for w in scheduler_stats(stack.scheduler).workers] == [256, 256]
