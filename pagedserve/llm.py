"""The offline engine API in vLLM's manner: ``LLM(model=...).generate(prompts, sampling_params)``.

It runs the same classes as the services, in one process: the scheduler and its block managers,
``LocalExecutor`` over model runners, and the gateway's tokenizer, detokenizer and stop strings.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.engine.messages import EngineRequest, FinishReason, SequenceId
from pagedserve.llm_outputs import CompletionOutput, SampleCollector, SampleOutput, best_samples  # noqa: F401 (re-exported)
from pagedserve.model_files import resolve_model
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.text.output_processor import TextDelta
from pagedserve.text.request_samples import ParsedRequest, RequestSamples, parse_request
from pagedserve.text.tokenizer import ChatTurn, PromptTokenizer
from pagedserve.engine.config import SchedulerStats
from pagedserve.engine.local_runners import build_local_runners
from pagedserve.engine.runner_config import EngineConfig
from pagedserve.engine.engine import Engine, LocalExecutor
from pagedserve.engine.scheduler import Scheduler

Prompt = str | Sequence[int]
"""A text prompt, or prompt token ids."""


def offline_config(**options: Any) -> EngineConfig:
    """The offline engine's config: :meth:`EngineConfig.of` with ``options``, where
    ``max_decode_slowdown`` defaults to ``inf`` (prefill chunks fill the token budget) and
    ``short_prompt_share`` to 0 (prompts are prefilled first come, first served).

    The services keep ``SchedulerConfig``'s 2 and 0.5: there a running stream's inter-token latency and
    a short request's time to first token are what they guard. An offline run has every request in hand,
    no stream to pace and no first token to hurry, and the pacing costs it throughput (256 ShareGPT
    requests in bfloat16: 0.91-0.92x of full chunks, docs/benchmarks.md); vLLM's offline ``LLM`` likewise
    takes larger prefill chunks than its server by default. A caller streaming through :meth:`LLM.step`
    beside long prompts can pass ``max_decode_slowdown=2`` and ``short_prompt_share=0.5``.

    Raises:
        TypeError, ValueError: as :meth:`EngineConfig.of`.
    """
    return EngineConfig.of(**{"max_decode_slowdown": math.inf, "short_prompt_share": 0.0, **options})


@dataclass(frozen=True)
class StreamDelta:
    """What one ``LLM.step`` produced for one sample of a request; ``error`` when the engine refused it."""

    request_id: str
    delta: TextDelta
    sample_index: int = 0
    error: str | None = None


class LLM:
    """An in-process engine over one or more model runners.

    Args:
        model: a local Hugging Face model folder; ``None`` for the default model.
        config: the engine's config (scheduler limits, runners, number of workers).
        rank_placement: with T*P > 1, a :class:`~pagedserve.engine.parallel.rank_link.RankPlacement`
            whose remote ranks (``pagedserve worker-rank``) rank 0 waits for; None: all spawned here.
        options: instead of ``config``, any of its fields by name (``LLM(block_size=8,
            gemm_backend="onednn")``, see :func:`offline_config`): KV-cache sizes per worker (and
            per rank with T*P > 1) as bytes or strings such as ``"512MiB"``, modes as enums or
            their values. One tensor- or pipeline-parallel ``LLM`` (one worker) per process at a
            time; call :meth:`close` to stop its helper ranks.

    Raises:
        TypeError: an unknown option, or options beside ``config``.
        ValueError: an invalid limit or size.
        pagedserve.engine.models.config.ModelConfigError: not a supported model folder.
    """

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None, *,
                 rank_placement=None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError(f"give config or options, not both (got {sorted(options)})")
        self.config = config or offline_config(**options)
        path = resolve_model(str(model) if model else None)
        self.tokenizer = PromptTokenizer.from_folder(path)
        runners = build_local_runners(path, self.config, rank_placement)
        self._runners = runners
        scheduler = Scheduler(self.config.scheduler, self.config.speculative_config)
        for worker_id, runner in runners.items():
            scheduler.add_worker(worker_id, runner.num_blocks, runner.num_cpu_blocks, self.config.runner.device)
        self.engine = Engine(scheduler, LocalExecutor(runners))  # a thread per worker id: virtual engines overlap
        self._states: dict[str, RequestSamples] = {}
        self._prompts: dict[str, tuple[int, ...]] = {}
        self._params: dict[str, SamplingParams] = {}
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the model threads and the helper ranks of tensor-parallel workers; idempotent."""
        self.engine.executor.shutdown()
        for runner in self._runners.values():
            if hasattr(runner, "close"):
                runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- streaming interface -------------------------------------------------------------
    def add_request(self, prompt: Prompt | Sequence[ChatTurn], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Tokenizes and queues a request; returns its id.

        ``prompt`` is text, token ids, or chat turns (rendered with the chat template).

        Raises:
            InvalidRequestError: invalid prompt or parameters; the message names the field.
        """
        params = params or SamplingParams()
        if isinstance(prompt, str):
            ids, field_name = self.tokenizer.encode_prompt(prompt), "prompt"
        elif prompt and isinstance(prompt[0], ChatTurn):
            ids, field_name = self.tokenizer.encode_chat(prompt), "chat"
        else:
            ids, field_name = self.tokenizer.check_token_ids(list(prompt)), "prompt_token_ids"
        return self.add_parsed(parse_request(self.tokenizer, ids, field_name, params), request_id)

    def add_parsed(self, parsed: ParsedRequest, request_id: str | None = None) -> str:
        """Queues an already validated request; returns its id."""
        request_id = request_id or f"req-{next(self._ids)}"
        self._states[request_id] = RequestSamples(self.tokenizer, parsed.prompt_token_ids, parsed.params)
        self._prompts[request_id] = parsed.prompt_token_ids
        self._params[request_id] = parsed.params
        self.engine.add_request(EngineRequest(request_id, parsed.prompt_token_ids, parsed.engine_params, time.time()))
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its blocks; False if it was not in flight."""
        self._states.pop(request_id, None)
        self._prompts.pop(request_id, None)
        self._params.pop(request_id, None)
        return bool(self.engine.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[StreamDelta]:
        """Runs one iteration; returns the text each sample gained (and which ones finished)."""
        deltas = []
        for output in self.engine.step():
            state = self._states.get(output.request_id)
            if state is None:
                continue
            delta = state.process(output)
            if delta.stop_string_matched:
                self.engine.abort_sample(SequenceId(output.request_id, output.sample_index))
            if state.finished:
                del self._states[output.request_id]
                del self._prompts[output.request_id]
                del self._params[output.request_id]
            error = output.error.message if output.error else None
            deltas.append(StreamDelta(output.request_id, delta, output.sample_index, error))
        return deltas

    def stats(self) -> SchedulerStats:
        return self.engine.scheduler.stats()

    # ---- batch interface -----------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Runs every prompt to completion; outputs in prompt order.

        ``prompts`` is one prompt or a list: text, or token ids (a list of ints).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        return self.run_to_completion(ids)

    def chat(self, conversations: Sequence[Sequence[ChatTurn]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Like ``generate`` for chat conversations (rendered with the model's chat template)."""
        params = self._params_per_prompt(sampling_params, len(conversations))
        return self.run_to_completion([self.add_request(list(c), sp) for c, sp in zip(conversations, params)])

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return list(params)

    def run_to_completion(self, request_ids: list[str]) -> list[CompletionOutput]:
        """Steps the engine until every request in ``request_ids`` finished; outputs in that order.

        A request with ``best_of > n`` returns its ``n`` samples of highest cumulative logprob.
        """
        n = {rid: len(self._states[rid].samples) for rid in request_ids}
        samples = {(rid, i): SampleCollector() for rid in request_ids for i in range(n[rid])}
        prompt_logprobs: dict[str, tuple] = {}
        errors: dict[str, str] = {}
        prompts = {rid: self._prompts[rid] for rid in request_ids}
        params = {rid: self._params[rid] for rid in request_ids}
        while any(c.finish_reason is None for c in samples.values()):
            for item in self.step():
                key = (item.request_id, item.sample_index)
                if key not in samples:
                    continue
                samples[key].add(item.delta)
                if item.delta.prompt_logprobs is not None:
                    prompt_logprobs[item.request_id] = item.delta.prompt_logprobs
                if item.error:
                    errors[item.request_id] = item.error
                    for i in range(n[item.request_id]):
                        samples[(item.request_id, i)].finish_reason = FinishReason.ABORT
        return [
            CompletionOutput(rid, prompts[rid], best_samples(
                [samples[(rid, i)].output(i, params[rid]) for i in range(n[rid])], params[rid]),
                errors.get(rid), prompt_logprobs.get(rid))
            for rid in request_ids
        ]

