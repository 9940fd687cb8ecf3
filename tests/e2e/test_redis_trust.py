"""What the services trust from Redis (issue #20), through the session's real stack: a writer to Redis
without the cluster token (a real Redis client) can neither make a client receive another prompt's
answer nor make the gateway take token events from a server of its own."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb import engine_pb2_grpc
from pagedserve.services.common.signed_records import sign_record
from tests.e2e.processes import scheduler_stats, stranger_server
from tests.e2e.test_scheduler_migration import metric
from tests.e2e.test_stack import QUESTIONS, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]

REFUSED = "pagedserve_redis_records_refused_total"


def token_ids(responses: list) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_a_forged_queued_request_under_a_clients_ids_does_not_change_what_it_receives(stack):
    """Issue #20, defect 3: a writer that joined the consumer group took a client's queued request
    and queued it again with its own prompt under the same request and gateway ids: the client got
    the answer to the attacker's prompt, status OK. The scheduler is paused while the attacker
    acts, so that it wins the race every time."""
    question = chat_request(QUESTIONS[1], max_tokens=8)
    expected = token_ids(stream(stack.gateway, question))
    attacker = redis.Redis.from_url(stack.redis_url)
    refused_before = metric(stack.metrics["scheduler"], REFUSED)
    scheduler = stack.processes["scheduler"].popen
    victim: list = []
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        time.sleep(0.5)  # past the scheduler's blocking read (200 ms), which Redis would still answer
        thread = threading.Thread(target=lambda: victim.append(stream(stack.gateway, question)))
        thread.start()
        reply = attacker.xreadgroup(redis_keys.SCHEDULER_GROUP, "intruder", {redis_keys.REQUEST_STREAM: ">"},
                                    count=1, block=10_000)
        (entry_id, fields), = reply[0][1]
        forged = pb.QueuedRequest.FromString(fields[redis_keys.REQUEST_FIELD])
        forged.prompt_token_ids[:] = list(reversed(forged.prompt_token_ids))  # the attacker's prompt
        attacker.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: forged.SerializeToString()})
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    thread.join(120)
    assert not thread.is_alive() and token_ids(victim[0]) == expected  # its own answer, taken back from the intruder
    assert metric(stack.metrics["scheduler"], REFUSED) == refused_before + 1
    log = stack.processes["scheduler"].log_text()
    assert log.count(f"ignoring a queued request from Redis (gateway: {forged.gateway_id!r})") == 1


class RecordingScheduler(engine_pb2_grpc.SchedulerServicer):
    """A stranger's server posing as a scheduler: records every call and would stream forged tokens."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def StreamOutputs(self, request, context):
        self.calls.append("StreamOutputs")
        yield pb.TokenEventBatch(events=[pb.TokenEvent(request_id="any", token_ids=[6, 6, 6])])


def test_a_forged_scheduler_registration_is_never_connected_to_and_logged_once(stack):
    """Issue #20: a forged output must never reach a client. A registration in the scheduler
    directory (with a live lease key) that is unsigned, signed with another token, or a genuine one
    copied under another id, points the gateway at a stranger's server: it is never called. Each
    is refused once by each process, not at every poll (defect 9: the scheduler logged it twice a
    second for as long as it stayed)."""
    fake = RecordingScheduler()
    server, port = stranger_server(engine_pb2_grpc.add_SchedulerServicer_to_server, fake)
    attacker = redis.Redis.from_url(stack.redis_url)
    tag = uuid.uuid4().hex[:8]
    forged = {f"unsigned-{tag}": None, f"other-token-{tag}": "another-cluster-token-0123456789"}
    before = {name: metric(stack.metrics[name], REFUSED) for name in ("gateway", "scheduler")}
    try:
        for scheduler_id, token in forged.items():
            reg = pb.SchedulerRegistration(scheduler_id=scheduler_id, address=f"127.0.0.1:{port}", instance_id=tag,
                                           num_blocks=1 << 20)
            if token:
                sign_record(reg, token)
            attacker.hset(redis_keys.SCHEDULERS_HASH, scheduler_id, reg.SerializeToString())
            attacker.set(redis_keys.scheduler_lease_key(scheduler_id), tag, px=30_000)
        genuine = attacker.hget(redis_keys.SCHEDULERS_HASH, "scheduler-0")
        attacker.hset(redis_keys.SCHEDULERS_HASH, f"copied-{tag}", genuine)  # signed, but not its id
        attacker.set(redis_keys.scheduler_lease_key(f"copied-{tag}"), pb.SchedulerRegistration.FromString(
            genuine).instance_id, px=30_000)
        time.sleep(3.0)  # six polls of the gateway, six ticks of the scheduler
        responses = stream(stack.gateway, chat_request(QUESTIONS[3], max_tokens=4))
        assert responses[-1].finish_reason and 6 not in token_ids(responses)[:1]
        assert fake.calls == []
        assert [w.worker_id for w in scheduler_stats(stack.scheduler).workers]  # the scheduler still runs workers
        for name in ("gateway", "scheduler"):
            log = stack.processes[name].log_text()
            assert [log.count(f"{sid}'") for sid in [*forged, f"copied-{tag}"]] == [1, 1, 1], name
            assert metric(stack.metrics[name], REFUSED) == before[name] + 3, name
    finally:
        for scheduler_id in [*forged, f"copied-{tag}"]:
            attacker.hdel(redis_keys.SCHEDULERS_HASH, scheduler_id)
            attacker.delete(redis_keys.scheduler_lease_key(scheduler_id))
        server.stop(0)
