"""The cold-compile phase of `bench structured-outputs`: the inter-token latency of free decode
streams while requests with slow-to-compile JSON schemas arrive.

On one engine, for each kind of arrival (:class:`Arrivals`): ``streams`` fresh greedy streams
(random 32-token prompts, EOS ignored) decode; once each has ``WARM_TOKENS`` + ``before_tokens``
tokens, ``arrivals`` requests (random 32-token prompts) are added at once; the streams run until
every arrival has ``arrival_tokens`` tokens, then all are stopped. Gaps between consecutive tokens
of the streams before the arrival and after it give the ITL; the ``FREE`` arrivals (no structure)
are the baseline, so their prefill is not counted as compiling. The arrivals' sampling parameters
(the gateway's spec check, a separate process in the services) are built before they arrive and
timed apart.
"""

from __future__ import annotations

import enum
import json
import random
import time
from dataclasses import dataclass

from pagedserve.bench.call_timer import CallTimer
from pagedserve.bench.grammar_schemas import slow_schemas
from pagedserve.bench.metrics import latency_stats

PROMPT_TOKENS = 32
WARM_TOKENS = 3
"""Tokens every stream has before its gaps count (its prefill is behind it)."""
STREAM_MAX_TOKENS = 4096
"""The streams' limit (they are stopped long before)."""


class Arrivals(enum.Enum):
    """What the arriving requests ask for."""

    FREE = "free"  # no structure: the baseline (their prefill alone)
    COLD = "cold"  # each a distinct slow schema the worker has not compiled
    WARM = "warm"  # the same schemas again: the worker's cache of compiled grammars


@dataclass(frozen=True)
class StallRun:
    """The free streams around one arrival (times in ms).

    Attributes:
        arrivals: ``Arrivals`` value.
        repeat: which repeat of the comparison (0 first).
        before_p50_ms, before_p99_ms: the streams' ITL before the arrival.
        during_p50_ms, during_p99_ms: after it, until every arrival has its tokens.
        longest_gap_ms: the longest gap of any stream after the arrival.
        arrival_ttft_max_ms: from the arrival to the last arrival's first token.
        worker_compile_ms: time the worker spent building grammars (``GrammarCompiler._new_pristine``)
            after the arrival, all arrivals together.
        longest_compile_ms: the slowest of those builds.
    """

    arrivals: str
    repeat: int
    before_p50_ms: float
    before_p99_ms: float
    during_p50_ms: float
    during_p99_ms: float
    longest_gap_ms: float
    arrival_ttft_max_ms: float
    worker_compile_ms: float
    longest_compile_ms: float


def slow_structures(count: int, seed: int) -> list:
    """``count`` distinct slow-to-compile JSON-schema structures (``grammar_schemas.slow_schemas``)."""
    from pagedserve.engine.structured_output import StructuredOutput, StructureKind

    return [StructuredOutput(StructureKind.JSON, json.dumps(s)) for s in slow_schemas(count, seed)]


def arrival_params(structures: list, arrival_tokens: int) -> tuple[list, list[float]]:
    """Sampling parameters of the arrivals (one per structure, ``None`` for a free one) and the ms
    each one's construction took (the gateway's check of its spec)."""
    from pagedserve.engine.sampling_params import SamplingParams

    params, check_ms = [], []
    for structure in structures:
        start = time.perf_counter()
        params.append(SamplingParams(max_tokens=arrival_tokens, temperature=0.0, ignore_eos=True,
                                     structured_output=structure))
        check_ms.append((time.perf_counter() - start) * 1000)
    return params, check_ms


def run_arrivals(llm, kind: Arrivals, repeat: int, params: list, streams: int, before_tokens: int, arrival_tokens: int,
                 rng: random.Random) -> StallRun:
    """One arrival of ``params`` (one request each) beside ``streams`` free streams on ``llm``."""
    from pagedserve.engine.grammar_matchers import GrammarCompiler
    from pagedserve.engine.sampling_params import SamplingParams

    def prompt() -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(PROMPT_TOKENS)]

    free = SamplingParams(max_tokens=STREAM_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {llm.add_request(prompt(), free): [] for _ in range(streams)}
    arrived: dict[str, list[float]] = {}
    arrived_at = 0.0
    with CallTimer(GrammarCompiler, "_new_pristine" if hasattr(GrammarCompiler, "_new_pristine") else "matcher") as compiles:  # on the compile thread, or the model thread
        while not arrived or any(len(t) < arrival_tokens for t in arrived.values()):
            outputs = llm.step()
            now = time.perf_counter()
            for item in outputs:
                (times if item.request_id in times else arrived)[item.request_id] += [now] * len(item.delta.token_ids)
            if not arrived and all(len(t) >= WARM_TOKENS + before_tokens for t in times.values()):
                arrived_at, n_before = now, len(compiles.calls)
                arrived = {llm.add_request(prompt(), p): [] for p in params}
    for request_id in [*times, *arrived]:
        llm.abort(request_id)
    before = [b - a for t in times.values() for a, b in zip(t[WARM_TOKENS:], t[WARM_TOKENS + 1:]) if b <= arrived_at]
    during = [b - max(a, arrived_at) for t in times.values() for a, b in zip(t, t[1:]) if b > arrived_at]
    builds = [seconds for _, seconds in compiles.calls[n_before:]]
    b, d = latency_stats(before), latency_stats(during)
    return StallRun(kind.value, repeat, b.median_ms, b.p99_ms, d.median_ms, d.p99_ms, 1000 * max(during),
                    1000 * (max(t[0] for t in arrived.values()) - arrived_at), 1000 * sum(builds),
                    1000 * max(builds, default=0.0))
