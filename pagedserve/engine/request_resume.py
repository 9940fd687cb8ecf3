"""Request migration, engine side: a scheduler takes over a request another one ran, continuing
from the tokens already delivered (as NVIDIA Dynamo's request migration does), so that the
client sees every token exactly once and the same text an undisturbed run would give.

The caller (``Scheduler.resume_request``) says per sample what the client already received
(``ResumedSample``). Finished samples do not run again. When nothing was delivered and nothing
finished, the request starts as a new one (``add_request``: sample 0 first, the other samples
forked after the prompt). Otherwise each unfinished sample ``i`` becomes a sequence of its own,
waiting to be computed again like a recompute-preempted sequence:

* its tokens are the prompt followed by its delivered tokens, which count as its output tokens:
  ``max_tokens``, ``min_tokens``, stop checks, the penalties, the logprobs and the seeded draw
  (which depends on the seed and the output index alone, ``sampling_params.derive_seed``) treat them as
  tokens generated here, on the scheduler and on the worker (``NewRequestData.num_prompt_tokens``
  separates prompt from output, as after a recompute preemption);
* its sampling parameters are ``child_sampling(request.sampling, i)``: sample 0 keeps the
  request's seed, sample i > 0 gets the seed it would have had after a fork, and each has
  ``n = 1`` (it forks nothing: a sample with nothing delivered starts from the prompt alone);
* its outputs continue at ``first_output_index = len(delivered)``; only sample 0 with nothing
  delivered still sends the prompt logprobs (the client got them with its first token otherwise,
  and a sample that needs none may take its prompt's blocks from the prefix cache).

The samples of a request with ``n > 1`` join its fork group (``parallel_sampling.Forks``), so
that aborting the request, or one sample, and ``has_request`` work as for a forked request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from pagedserve.engine.messages import EngineRequest, ResumedSample
from pagedserve.engine.sampling_params import EngineSamplingParams, child_sampling
from pagedserve.engine.sequence import Sequence


def check_resumed(request: EngineRequest, resumed: Seq[ResumedSample]) -> None:
    """Checks what the client received of each sample against the request.

    Raises:
        ValueError: naming the entry (``resumed[j].field``): a sample index outside ``[0, n)``
            or listed twice, more output tokens than ``max_tokens``, or an unfinished sample
            whose delivered tokens already end it (a stop token or ``max_tokens``; the output
            that carried that token also carried its finish reason).
    """
    sampling = request.sampling
    seen: set[int] = set()
    for j, sample in enumerate(resumed):
        name = f"resumed[{j}]"
        index, tokens = sample.sample_index, sample.output_token_ids
        if not 0 <= index < sampling.n:
            raise ValueError(f"{name}.sample_index: {index} is not in [0, {sampling.n}) (the request's samples)")
        if index in seen:
            raise ValueError(f"{name}.sample_index: sample {index} is listed twice")
        seen.add(index)
        if len(tokens) > sampling.max_tokens:
            raise ValueError(f"{name}.output_token_ids: {len(tokens)} tokens, more than max_tokens "
                             f"({sampling.max_tokens})")
        end = _end_position(sampling, tokens)
        if end is not None and not sample.finished:
            raise ValueError(f"{name}.finished: output token {end - 1} ({tokens[end - 1]}) ends the sample "
                             "(a stop token or max_tokens), yet it is not finished")


def _end_position(sampling: EngineSamplingParams, tokens: Seq[int]) -> int | None:
    """How many of ``tokens`` there are up to the one that ends the sample (a stop or EOS token
    once ``min_tokens`` are out, or the ``max_tokens``-th); ``None`` when none ends it."""
    for position, token_id in enumerate(tokens, 1):
        if sampling.stops_at(token_id, position) or position >= sampling.max_tokens:
            return position
    return None


def starts_fresh(resumed: Seq[ResumedSample]) -> bool:
    """Whether no sample got a token and none finished: the request starts as a new one."""
    return not any(sample.output_token_ids or sample.finished for sample in resumed)


def resumed_sequences(request: EngineRequest, resumed: Seq[ResumedSample]) -> list[Sequence]:
    """One waiting sequence per unfinished sample, in sample order (a sample not in ``resumed``
    got nothing yet); empty when every sample finished. ``resumed`` must pass ``check_resumed``."""
    by_index = {sample.sample_index: sample for sample in resumed}
    sequences = []
    for index in range(request.sampling.n):
        sample = by_index.get(index, ResumedSample(index, (), False))
        if not sample.finished:
            sequences.append(_resumed_sequence(request, index, sample.output_token_ids))
    return sequences


def _resumed_sequence(request: EngineRequest, sample_index: int, delivered: Seq[int]) -> Sequence:
    """Sample ``sample_index`` as a sequence whose output so far is ``delivered``."""
    sampling = child_sampling(request.sampling, sample_index)
    if delivered:  # the client got the prompt logprobs with the first token
        sampling = dataclasses.replace(sampling, prompt_logprobs=None)
    seq = Sequence(request, sample_index, sampling)
    seq.output_token_ids = list(delivered)
    return seq
