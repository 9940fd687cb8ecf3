"""How a request lives through the services (real processes, Redis and gRPC): every sample ends,
ids never cross, aborts and cancellations end streams, a long prefill stalls no other worker (across a
crash or a Redis restart: test_requests_across_restarts.py). Each test reproduces a defect found on the
way (issue #9, #13, #20) and failed on the code before its fix. They run on the small random-weight
model (``small_stack``), whose checks hold on any model, but for the long prefill, which must take
seconds (the default model's ``stack``)."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.auth import CLUSTER_TOKEN_KEY
from pagedserve.services.common.limits import MAX_HELD_QUERY_IDS
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb import engine_pb2_grpc
from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb import generate_pb2_grpc
from pagedserve.services.common.signed_records import sign_record
from tests.e2e.faults import Call
from tests.e2e.processes import CLUSTER_TOKEN, scheduler_stats, stranger_server, status_of, wait_until
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def sampled_request(question: str, n: int, max_tokens: int, request_id: str = "") -> gen.GenerateRequest:
    request = gen.GenerateRequest(request_id=request_id, sampling_params=gen.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=3, n=n, ignore_eos=True))
    request.chat.messages.add(role="user", content=question)
    return request


def tokens_by_sample(responses: list[gen.GenerateResponse]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in responses:
        out.setdefault(r.index, []).extend(r.token_ids)
    return out


@pytest.mark.parametrize("n", [2, 4, 8])
def test_n_samples_all_end_when_they_finish_in_the_same_step(small_stack, n):
    """Defect 1: the route was dropped at the first finished sample; the others hung."""
    responses = stream(small_stack.gateway, sampled_request(QUESTIONS[4], n, max_tokens=6))
    finished = {r.index: r.finish_reason for r in responses if r.finish_reason}
    assert finished == {i: gen.FINISH_REASON_LENGTH for i in range(n)}
    assert {i: len(t) for i, t in tokens_by_sample(responses).items()} == {i: 6 for i in range(n)}
    assert responses[-1].usage.completion_tokens == 6 * n
    assert_all_blocks_free(small_stack)


def test_client_ids_cannot_name_another_requests_sample(small_stack):
    """Defect 2: "X#1" while X (n = 2) ran crashed the scheduler; the reverse order removed every worker."""
    for first, second in ((("X", 2), ("X#1", 1)), (("Y#1", 1), ("Y", 2))):
        with ThreadPoolExecutor(2) as pool:
            # 200 tokens: X still runs when X#1 comes (12 ran ~0.1 s on the small model)
            futures = [pool.submit(stream, small_stack.gateway, sampled_request(QUESTIONS[i], n, 200, rid))
                       for i, (rid, n) in enumerate((first, second))]
            results = [f.result(timeout=300) for f in futures]
        for (rid, n), responses in zip((first, second), results):
            assert all(r.request_id == rid for r in responses)
            assert sorted(r.index for r in responses if r.finish_reason) == list(range(n))
    assert len(scheduler_stats(small_stack.scheduler).workers) == 2
    assert_all_blocks_free(small_stack)


def test_a_reused_request_id_gets_only_its_own_tokens(small_stack, small_offline_outputs):
    """Defect 3: reusing an id right after its call ended gave UNKNOWN, a hang, or another request's tokens."""
    questions = QUESTIONS[:6]
    for question in questions:  # one after another, each as soon as the one before ended
        request = chat_request(question)
        request.request_id = "same-id"
        responses = stream(small_stack.gateway, request)
        assert [t for r in responses for t in r.token_ids] == list(small_offline_outputs[question].token_ids)
    with ThreadPoolExecutor(4) as pool:  # the same label on concurrent calls, too
        requests = [chat_request(q) for q in questions[:4]]
        for request in requests:
            request.request_id = "shared"
        results = list(pool.map(lambda r: stream(small_stack.gateway, r), requests))
    for question, responses in zip(questions, results):
        assert [t for r in responses for t in r.token_ids] == list(small_offline_outputs[question].token_ids)


def test_a_cancelled_call_is_forgotten_and_the_id_reused_at_once(small_stack, small_offline_outputs):
    """Defect 3: late tokens of a cancelled submission must never reach a new one with the same id."""
    long_request = chat_request(QUESTIONS[5], max_tokens=200, ignore_eos=True)
    long_request.request_id = "again"
    with grpc.insecure_channel(small_stack.gateway) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(long_request, timeout=300)
        next(call)
        call.cancel()
    request = chat_request(QUESTIONS[0])
    request.request_id = "again"
    responses = stream(small_stack.gateway, request)
    assert [t for r in responses for t in r.token_ids] == list(small_offline_outputs[QUESTIONS[0]].token_ids)
    assert_all_blocks_free(small_stack)


def _queued_keys(redis_url: str) -> list[str]:
    entries = redis.Redis.from_url(redis_url).xrange(redis_keys.REQUEST_STREAM)
    return [pb.QueuedRequest.FromString(fields[redis_keys.REQUEST_FIELD]).request_id for _, fields in entries]


def test_an_abort_from_the_scheduler_ends_the_client_stream(small_stack):
    """Defect 9: a request aborted in the scheduler sent its client nothing; it hung to its deadline."""
    responses: list = []
    first = threading.Event()

    def client() -> None:
        with grpc.insecure_channel(small_stack.gateway) as channel:
            for r in generate_pb2_grpc.GenerationStub(channel).Generate(
                    chat_request(QUESTIONS[6], max_tokens=400, ignore_eos=True), timeout=300):
                responses.append(r)
                first.set()

    thread = threading.Thread(target=client)
    thread.start()
    assert first.wait(120)
    [key] = _queued_keys(small_stack.redis_url)
    token = ((CLUSTER_TOKEN_KEY, CLUSTER_TOKEN),)
    with grpc.insecure_channel(small_stack.scheduler) as channel:
        scheduler = engine_pb2_grpc.SchedulerStub(channel)
        def held() -> list[str]:  # what a gateway's HeldCheck asks
            return list(scheduler.HeldRequests(pb.HeldRequestsRequest(request_ids=[key, "no-such"]), metadata=token,
                                               timeout=30).request_ids)
        assert held() == [key]
        started = time.monotonic()
        found = scheduler.Abort(pb.AbortRequest(request_id=key), metadata=token, timeout=30).found
        thread.join(30)
        assert held() == []
        too_many = pb.HeldRequestsRequest(request_ids=[key] * (MAX_HELD_QUERY_IDS + 1))
        assert status_of(lambda: scheduler.HeldRequests(too_many, metadata=token, timeout=30)) \
            == grpc.StatusCode.INVALID_ARGUMENT
    assert found and not thread.is_alive(), "the client was not told"
    assert time.monotonic() - started < 10
    assert responses[-1].finish_reason == gen.FINISH_REASON_ABORT
    assert len([t for r in responses for t in r.token_ids]) < 400
    assert_all_blocks_free(small_stack)


def test_huge_stop_token_lists_never_reach_the_workers(small_stack):
    """Defect 4: 1.4 M stop token ids made plans larger than a worker's receive limit; every worker was dropped."""
    request = chat_request(QUESTIONS[3], max_tokens=4)
    request.sampling_params.stop_token_ids.extend([7] * 1_400_000)
    with pytest.raises(grpc.RpcError) as info:
        stream(small_stack.gateway, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(scheduler_stats(small_stack.scheduler).workers) == 2
    assert stream(small_stack.gateway, chat_request(QUESTIONS[3], max_tokens=4))[-1].finish_reason


def test_a_long_prefill_on_one_worker_does_not_stall_the_other(stack):
    """Defect 8: workers ran in lockstep, so one worker's long prefill froze every other worker's streams."""
    arrivals: list[float] = []
    first = threading.Event()

    def decode_stream() -> None:
        with grpc.insecure_channel(stack.gateway) as channel:
            for _ in generate_pb2_grpc.GenerationStub(channel).Generate(
                    chat_request(QUESTIONS[7], max_tokens=120, ignore_eos=True), timeout=300):
                arrivals.append(time.monotonic())
                first.set()

    thread = threading.Thread(target=decode_stream)
    thread.start()
    assert first.wait(120)
    time.sleep(0.5)
    # A 700-token prompt (~3 s to prefill on a core, ~50 decode steps' time): placed on the other worker (the one
    # with the most free blocks).
    long_prompt = gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=[100 + i % 5000 for i in range(700)]),
                                      sampling_params=gen.SamplingParams(max_tokens=1, temperature=0.0))
    sent = time.monotonic()
    stream(stack.gateway, long_prompt)
    prefill_s = time.monotonic() - sent
    thread.join(300)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if a >= sent and b <= sent + prefill_s]
    assert gaps, "the decode stream produced nothing while the prefill ran"
    assert max(gaps) < 0.5 * prefill_s, (max(gaps), prefill_s)
    assert_all_blocks_free(stack)


class RecordingWorker(engine_pb2_grpc.WorkerServicer):
    """A stranger's gRPC server posing as a worker: records the metadata of every call it gets."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def Execute(self, request, context):
        self.calls.append(dict(context.invocation_metadata()))
        return pb.StepResult(step_id=request.step_id)


@pytest.mark.parametrize("signing_token", ["", "not-the-cluster-token-0123456789"])
def test_a_registration_written_to_redis_without_the_token_is_ignored(small_stack, signing_token):
    """Review finding: anyone who could write to Redis could register a worker, then receive plans
    (every prompt, and the cluster token) and answer with forged tokens."""
    fake = RecordingWorker()
    server, port = stranger_server(engine_pb2_grpc.add_WorkerServicer_to_server, fake)
    client = redis.Redis.from_url(small_stack.redis_url)
    reg = pb.WorkerRegistration(worker_id="evil", address=f"127.0.0.1:{port}", num_blocks=100000, block_size=16,
                                instance_id="evil-1")
    if signing_token:
        sign_record(reg, signing_token)
    try:
        for _ in range(8):  # keep it fresh for 4 s: eight registry polls
            client.hset(redis_keys.WORKERS_HASH, "evil", reg.SerializeToString())
            client.set(redis_keys.worker_heartbeat_key("evil"), b"1", px=3000)
            time.sleep(0.5)
        assert stream(small_stack.gateway, chat_request(QUESTIONS[0], max_tokens=4))[-1].finish_reason
        assert sorted(w.worker_id for w in scheduler_stats(small_stack.scheduler).workers) == ["worker-0", "worker-1"]
        assert fake.calls == []
    finally:
        client.hdel(redis_keys.WORKERS_HASH, "evil")
        server.stop(0)


def _gateway_id(stack) -> str:
    return re.search(r"gateway (\S+) listening on", stack.processes["gateway"].log_text()).group(1)


def test_a_second_output_stream_for_a_gateway_does_not_wedge_it(small_stack):
    """Review finding: a second StreamOutputs under a live gateway's id split its events, and when
    it closed the gateway counted as gone: after the grace period nothing reached it any more."""
    # 2,000 tokens (~10 s on the small model here): still streaming while the intruder holds the stream
    victim = Call(0, chat_request(QUESTIONS[5], max_tokens=2000, ignore_eos=True))
    thread = threading.Thread(target=victim.run, args=(small_stack.gateway,))
    thread.start()
    assert victim.decoding.wait(120), "the victim produced no tokens"
    assert thread.is_alive(), "the victim ended before the intruder came: nothing would be tested"
    with grpc.insecure_channel(small_stack.scheduler) as channel:
        intruder = engine_pb2_grpc.SchedulerStub(channel).StreamOutputs(
            pb.StreamOutputsRequest(gateway_id=_gateway_id(small_stack)),
            metadata=((CLUSTER_TOKEN_KEY, CLUSTER_TOKEN),))
        reader = threading.Thread(target=lambda: [None for _ in intruder], daemon=True)
        reader.start()
        time.sleep(2.0)
        intruder.cancel()
    thread.join(120)
    # The victim may lose tokens to the intruder (who holds the token): then it ends with ABORTED; had it lost its
    # last output, UNAVAILABLE within 60 s (pagedserve/services/gateway/held_check.py).
    assert not thread.is_alive() and victim.code in (None, grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE), (
        victim.code, victim.details)
    time.sleep(11.0)  # past the scheduler's 10 s grace for a gateway whose stream closed
    with grpc.insecure_channel(small_stack.gateway) as channel:  # within 30 s, not never
        responses = list(generate_pb2_grpc.GenerationStub(channel).Generate(
            chat_request(QUESTIONS[2], max_tokens=8), timeout=30))
    assert responses[-1].finish_reason
    assert_all_blocks_free(small_stack)


def test_requests_of_a_gateway_that_never_connects_never_run(small_stack):
    """A restarted stack found a previous run's requests in Redis and ran them for nobody until
    their gateway's grace ran out; now they wait, without running, and are dropped then."""
    client = redis.Redis.from_url(small_stack.redis_url)
    record = pb.QueuedRequest(request_id="left-from-yesterday", gateway_id="gateway-gone", prompt_token_ids=[1] * 40,
                              sampling_params=pb.EngineSamplingParams(max_tokens=400, ignore_eos=True))
    client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: record.SerializeToString()})
    steps_before = scheduler_stats(small_stack.scheduler).num_steps
    time.sleep(2.0)
    stats = scheduler_stats(small_stack.scheduler)
    assert (stats.num_steps, stats.num_running, stats.num_waiting) == (steps_before, 0, 0)
    wait_until(lambda: client.xlen(redis_keys.REQUEST_STREAM) == 0, "the entry dropped after the grace", 20)
    assert scheduler_stats(small_stack.scheduler).num_steps == steps_before
