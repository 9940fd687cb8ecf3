"""Authentication against real processes: the cluster token guards the Scheduler and Worker
services, an API key and TLS guard a gateway; health and reflection stay open."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
import redis
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve.services.common.auth import CLUSTER_TOKEN_KEY, bearer_metadata
from pagedserve.services.common.grpc_server import check_health
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb import engine_pb2_grpc, generate_pb2_grpc
from pagedserve.services.common.redis_keys import WORKERS_HASH
from tests.e2e.ports import free_port
from tests.e2e.processes import pagedserve, scheduler_stats, status_of, wait_until
from tests.e2e.test_stack import QUESTIONS, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]

API_KEY = "test-api-key-0123456789"
BAD_TOKENS = [None, "wrong-token"]


def token_metadata(token: str | None) -> tuple:
    return () if token is None else ((CLUSTER_TOKEN_KEY, token),)


@pytest.mark.parametrize("service", ["scheduler", "worker", "gateway"])
def test_a_service_without_a_cluster_token_refuses_to_start(service, default_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_CLUSTER_TOKEN"}
    model = [] if service == "scheduler" else ["--model", str(default_model)]
    result = subprocess.run([sys.executable, "-m", "pagedserve", service, "--redis-url", "redis://127.0.0.1:1/0",
                             "--port", "0", *model], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"pagedserve {service}: no cluster token" in result.stderr
    assert "PAGEDSERVE_CLUSTER_TOKEN" in result.stderr and "pagedserve up" in result.stderr


@pytest.mark.parametrize("token", BAD_TOKENS)
def test_the_scheduler_refuses_calls_without_the_cluster_token(stack, token):
    metadata = token_metadata(token)
    with grpc.insecure_channel(stack.scheduler) as channel:
        stub = engine_pb2_grpc.SchedulerStub(channel)
        assert status_of(lambda: stub.GetStats(pb.GetStatsRequest(), metadata=metadata, timeout=10)) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert status_of(lambda: stub.Abort(pb.AbortRequest(request_id="x"), metadata=metadata, timeout=10)) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert status_of(lambda: stub.HeldRequests(pb.HeldRequestsRequest(request_ids=["x"]), metadata=metadata,
                                                   timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        events = stub.StreamOutputs(pb.StreamOutputsRequest(gateway_id="intruder"), metadata=metadata, timeout=10)
        assert status_of(lambda: next(events)) == grpc.StatusCode.UNAUTHENTICATED
    assert check_health(stack.scheduler)  # probes need no token


def test_workers_refuse_execute_without_the_cluster_token(stack):
    registrations = redis.Redis.from_url(stack.redis_url).hgetall(WORKERS_HASH).values()
    addresses = [pb.WorkerRegistration.FromString(r).address for r in registrations]
    assert len(addresses) == 2
    for address in addresses:
        for token in BAD_TOKENS:
            with grpc.insecure_channel(address) as channel:
                plan = pb.BatchPlan(step_id=1, session_id="intruder")
                call = lambda: engine_pb2_grpc.WorkerStub(channel).Execute(plan, metadata=token_metadata(token), timeout=10)  # noqa: E731
                assert status_of(call) == grpc.StatusCode.UNAUTHENTICATED
        assert check_health(address)
    # the stack was not disturbed: it still serves, with both workers
    assert stream(stack.gateway, chat_request(QUESTIONS[3], max_tokens=4))[-1].finish_reason
    assert len(scheduler_stats(stack.scheduler).workers) == 2


def make_self_signed_cert(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost and its key, made with the openssl command."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def tls_gateway(stack, tmp_path_factory, default_model):
    """A second gateway on the session stack: TLS with a self-signed certificate, and an API key."""
    tmp = tmp_path_factory.mktemp("tls-gateway")
    cert, key = make_self_signed_cert(tmp)
    port, http_port = free_port(), free_port()
    env = {**stack.env, "PAGEDSERVE_API_KEY": API_KEY}
    process = pagedserve("tls-gateway", [
        "gateway", "--redis-url", stack.redis_url, "--model", str(default_model), "--host", "127.0.0.1",
        "--port", str(port), "--http-port", str(http_port),
        "--tls-cert-file", cert, "--tls-key-file", key], tmp, env)
    credentials = grpc.ssl_channel_credentials(open(cert, "rb").read())
    target = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: check_health(target, credentials=credentials), "TLS gateway", 120, [process])
        yield {"target": target, "credentials": credentials, "cert": cert, "env": env,
               "http": f"https://127.0.0.1:{http_port}"}
    finally:
        process.stop()


def tls_generate(gateway, metadata, max_tokens: int = 24) -> list:
    with grpc.secure_channel(gateway["target"], gateway["credentials"]) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        return list(stub.Generate(chat_request(QUESTIONS[0], max_tokens=max_tokens), metadata=metadata, timeout=120))


@pytest.mark.parametrize("metadata", [(), bearer_metadata("wrong"), (("authorization", API_KEY),)],
                         ids=["no key", "wrong key", "key without Bearer"])
def test_the_gateway_refuses_generate_without_its_api_key(tls_gateway, metadata):
    assert status_of(lambda: tls_generate(tls_gateway, metadata)) == grpc.StatusCode.UNAUTHENTICATED


def test_with_its_api_key_over_tls_the_gateway_answers_like_the_plain_one(stack, tls_gateway):
    responses = tls_generate(tls_gateway, bearer_metadata(API_KEY))
    expected = stream(stack.gateway, chat_request(QUESTIONS[0]))
    assert responses[-1].finish_reason and "Paris" in "".join(r.text for r in responses)
    assert [t for r in responses for t in r.token_ids] == [t for r in expected for t in r.token_ids]


def test_plaintext_clients_cannot_talk_to_the_tls_gateway(tls_gateway):
    with grpc.insecure_channel(tls_gateway["target"]) as channel:
        call = lambda: list(generate_pb2_grpc.GenerationStub(channel).Generate(  # noqa: E731
            chat_request(QUESTIONS[0]), metadata=bearer_metadata(API_KEY), timeout=10))
        assert status_of(call) == grpc.StatusCode.UNAVAILABLE


def test_reflection_stays_open_without_a_key(tls_gateway):
    with grpc.secure_channel(tls_gateway["target"], tls_gateway["credentials"]) as channel:
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert "pagedserve.v1.Generation" in names


def test_complete_sends_the_api_key_and_trusts_the_ca_file(tls_gateway):
    args = [sys.executable, "-m", "pagedserve", "complete", "--target", tls_gateway["target"], "--tls-ca-file",
            tls_gateway["cert"], "--chat", "--prompt", QUESTIONS[0], "--temperature", "0", "--max-tokens", "16"]
    ok = subprocess.run(args, capture_output=True, text=True, env=tls_gateway["env"], timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "Paris" in ok.stdout
    no_key = {k: v for k, v in tls_gateway["env"].items() if k != "PAGEDSERVE_API_KEY"}
    refused = subprocess.run(args, capture_output=True, text=True, env=no_key, timeout=120)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
