"""Timing the in-process engine (``pagedserve.llm.LLM``), shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Sequence


def ttft_ms(llm, prompt: str | Sequence[int]) -> float:
    """Time for ``prompt`` (text or token ids), sent alone to an idle ``llm``, to get its first
    token, in ms (greedy, one output token)."""
    from pagedserve.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while llm.has_unfinished_requests():
        llm.step()
    return (time.perf_counter() - start) * 1000
