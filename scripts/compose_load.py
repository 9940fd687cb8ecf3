"""Concurrent streamed gRPC requests for scripts/compose-check.sh, run inside the gateway's container
(``docker-compose exec -T gateway python - N MAX_TOKENS < scripts/compose_load.py``): it needs only
the image (grpc and pagedserve's stubs), the gateway at 127.0.0.1:50051 and PAGEDSERVE_API_KEY.

Each request asks for MAX_TOKENS tokens with ``ignore_eos``, so a stream is complete when it ends
with finish reason LENGTH after exactly MAX_TOKENS tokens. Prints ``STREAMING`` once every stream
has its first 4 tokens (compose-check.sh kills a worker then), then one line per stream and exits
0 when every stream completed, 1 otherwise.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import grpc

from pagedserve.services.common.auth import bearer_metadata
from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb import generate_pb2_grpc

TARGET = "127.0.0.1:50051"
TOKENS_BEFORE_STREAMING = 4
TIMEOUT_S = 300.0


def stream(index: int, max_tokens: int, results: list, started: threading.Barrier) -> None:
    """One request; stores ``(tokens, finish_reason, error)`` in ``results[index]``."""
    tokens, finish, error, waited = 0, "", "", False
    request = gen.GenerateRequest(prompt=f"Story number {index}: once upon a time",
                                  sampling_params=gen.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                     temperature=0.0))
    try:
        with grpc.insecure_channel(TARGET) as channel:
            replies = generate_pb2_grpc.GenerationStub(channel).Generate(
                request, timeout=TIMEOUT_S, metadata=bearer_metadata(os.environ.get("PAGEDSERVE_API_KEY", "")))
            for reply in replies:
                before = tokens
                tokens += len(reply.token_ids)
                if before < TOKENS_BEFORE_STREAMING <= tokens:
                    waited = True
                    started.wait()
                if reply.finish_reason:
                    finish = gen.FinishReason.Name(reply.finish_reason)
    except grpc.RpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
    except threading.BrokenBarrierError:
        pass
    if not waited:  # ended before its first tokens: do not keep the others waiting
        started.abort()
    results[index] = (tokens, finish, error)


def main(num_requests: int, max_tokens: int) -> int:
    results: list = [None] * num_requests
    started = threading.Barrier(num_requests + 1, timeout=TIMEOUT_S)
    threads = [threading.Thread(target=stream, args=(i, max_tokens, results, started)) for i in range(num_requests)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        started.wait()
        print(f"STREAMING after {time.monotonic() - began:.1f} s", flush=True)
    except threading.BrokenBarrierError:
        print("not every stream started", flush=True)
    for thread in threads:
        thread.join()
    ok = True
    for index, (tokens, finish, error) in enumerate(results):
        complete = tokens == max_tokens and finish == "FINISH_REASON_LENGTH" and not error
        ok &= complete
        print(f"stream {index}: {tokens} tokens, {finish or '-'} {error} {'ok' if complete else 'INCOMPLETE'}")
    print(f"{num_requests} streams in {time.monotonic() - began:.1f} s: {'all complete' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
