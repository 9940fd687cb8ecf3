"""Greedy gRPC streams read on threads of their own, each token's arrival time recorded: how the
inter-token-latency tests watch decoding streams while something else arrives."""

from __future__ import annotations

import threading
import time

import grpc

from pagedserve.services.common.pb import generate_pb2 as gen


def token_request(token_ids: list[int], max_tokens: int) -> gen.GenerateRequest:
    """A greedy request for ``token_ids`` that decodes ``max_tokens`` tokens (EOS ignored)."""
    request = gen.GenerateRequest(sampling_params=gen.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True))
    request.prompt_token_ids.ids.extend(token_ids)
    return request


class TimedStreams:
    """Streams ``requests`` through ``stub`` until the ``with`` block ends (then they are cancelled).

    Attributes:
        arrivals: per stream, the ``time.monotonic()`` of each token it received.
    """

    def __init__(self, stub, requests: list[gen.GenerateRequest], timeout_s: float = 180) -> None:
        self.arrivals: list[list[float]] = [[] for _ in requests]
        self._calls = [stub.Generate(r, timeout=timeout_s) for r in requests]
        self._readers = [threading.Thread(target=self._read, args=(i,)) for i in range(len(requests))]

    def _read(self, i: int) -> None:
        try:
            for response in self._calls[i]:
                self.arrivals[i] += [time.monotonic()] * len(response.token_ids)
        except grpc.RpcError:
            pass  # cancelled at the end

    def __enter__(self) -> TimedStreams:
        for reader in self._readers:
            reader.start()
        return self

    def __exit__(self, *exc) -> None:
        for call in self._calls:
            call.cancel()
        for reader in self._readers:
            reader.join()

    def gaps_before(self, skip: int) -> list[float]:
        """Gaps between consecutive tokens so far, after each stream's first ``skip`` tokens, seconds."""
        return [b - a for t in self.arrivals for a, b in zip(t[skip:], t[skip + 1:])]

    def gaps_during(self, start: float, end: float) -> list[float]:
        """Every gap that ended after ``start``, counted from ``start`` at most, and each stream's
        open gap at ``end`` (a stream stuck behind a step), seconds."""
        return [b - max(a, start) for t in self.arrivals for a, b in zip(t, [*t[1:], end]) if b > start]
