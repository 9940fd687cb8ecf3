"""The offline engine API in vLLM's manner: ``LLM(model=...).generate(prompts, sampling_params)``.

It runs the same classes as the services, in one process: the scheduler and its block managers,
``LocalExecutor`` over model runners, and the gateway's tokenizer, detokenizer and stop strings.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.messages import EngineRequest, FinishReason, SequenceId
from pagedserve.llm_outputs import CompletionOutput, SampleCollector, SampleOutput, best_samples  # noqa: F401 (re-exported)
from pagedserve.model_files import resolve_model
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.units import parse_bytes
from pagedserve.text.output_processor import TextDelta
from pagedserve.text.request_samples import ParsedRequest, RequestSamples
from pagedserve.text.tokenizer import ChatTurn, PromptTokenizer, check_prompt_length
from pagedserve.engine.config import SchedulerConfig, SchedulerStats, default_token_budget
from pagedserve.engine.engine import Engine, LocalExecutor
from pagedserve.engine.scheduler import Scheduler

Prompt = str | Sequence[int]
"""A text prompt, or prompt token ids."""


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
        kv_cache_memory: KV-cache bytes per worker (an int, or a string such as ``"512MiB"``).
        block_size, max_num_seqs, max_num_batched_tokens: scheduler limits (see SchedulerConfig);
            the token budget defaults to :func:`~pagedserve.engine.config.default_token_budget` of ``device``.
        num_workers: model runners, each with its own weights and KV cache.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 elsewhere), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: torch device of the runners.
        attention_backend: ``"auto"`` (Triton on CUDA, the C++ op elsewhere), ``"cpu"``, ``"torch"`` or ``"triton"``.
        gemm_backend: ``"torch"`` (``F.linear``: greedy output token-identical to transformers) or
            ``"onednn"`` (prepacked oneDNN GEMMs on CPU: 2-3x faster matmuls, float32 sums in
            another order, so greedy output can differ from transformers at near-ties; opt-in).
        compile_mode: ``"eager"`` or ``"inductor"`` (the dense part compiled by ``torch.compile``:
            shorter steps on CPU after tens of seconds of compiling here; reductions in another
            order, so greedy output can differ from transformers at near-ties; opt-in).
        enable_chunked_prefill, enable_prefix_caching, preemption_mode, policy: see SchedulerConfig.
        swap_space: CPU bytes per worker for swapped-out blocks (``preemption_mode="swap"``).
        tensor_parallel_size: ranks per worker (Megatron-LM sharding, Llama/Mistral/Qwen2 only; eager
            ``torch`` GEMMs): rank 0 runs here, T-1 helper processes hold the other shards.
            ``kv_cache_memory`` and ``swap_space`` are per rank. Call :meth:`close` to stop the helpers;
            one tensor-parallel ``LLM`` (one worker) per process at a time.
        pipeline_parallel_size: pipeline stages per worker (consecutive layers per stage, same
            models and limits as ``tensor_parallel_size``; ``T * P`` ranks, rank 0 here): the KV
            cache of each rank holds only its stage's layers, so the worker's blocks grow with P.
        num_virtual_engines: with ``pipeline_parallel_size`` P > 1, how many virtual engines the
            worker has (default P): each is a worker id to the scheduler (``worker-0/ve<i>``), with
            its own sequences and ``1/V`` of each rank's KV budget; their plans overlap in the stages.
        max_plans_in_flight: 2 (overlap scheduling: the next plan is made while the model runs)
            or 1 (made after); see SchedulerConfig. Outputs are the same.
        placement: with several workers, ``"prefix"`` (most cached prompt prefix, balanced against
            load) or ``"least-loaded"`` (most free blocks); see SchedulerConfig.
        max_decode_slowdown: how much longer than its decodes alone a step with prefill chunks beside
            them may take (predicted); see SchedulerConfig and ``pagedserve/engine/step_cost.py``.
        rank_placement: with T*P > 1, a :class:`~pagedserve.engine.parallel.rank_link.RankPlacement`
            whose remote ranks (``pagedserve worker-rank``) rank 0 waits for; None: all spawned here.

    Raises:
        ValueError: an invalid limit or size.
        pagedserve.engine.models.config.ModelConfigError: not a supported model folder.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        kv_cache_memory: int | str = "1GiB",
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        num_workers: int = 1,
        dtype: str = "auto",
        device: str = "cpu",
        attention_backend: str = "auto",
        gemm_backend: str = "torch",
        compile_mode: str = "eager",
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        swap_space: int | str = 0,
        policy: str = "fcfs",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        num_virtual_engines: int | None = None,
        max_plans_in_flight: int = 2,
        placement: str = "prefix",
        max_decode_slowdown: float = SchedulerConfig.max_decode_slowdown,
        rank_placement=None,
    ) -> None:
        import torch

        from pagedserve.engine.runner_factory import resolve_dtype
        from pagedserve.engine.runner_factory import build_model_runner

        path = resolve_model(str(model) if model else None)
        self.tokenizer = PromptTokenizer.from_folder(path)
        memory = parse_bytes(kv_cache_memory) if isinstance(kv_cache_memory, str) else kv_cache_memory
        swap = parse_bytes(swap_space) if isinstance(swap_space, str) else swap_space
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_token_budget(device)
        config = SchedulerConfig(block_size, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
                                 enable_prefix_caching, preemption_mode, policy, max_plans_in_flight,
                                 placement, max_decode_slowdown)
        engines = num_virtual_engines or 1
        if engines < 1 or (engines > 1 and pipeline_parallel_size == 1):
            raise ValueError(f"num_virtual_engines={num_virtual_engines}: give 1, or more than 1 with "
                             f"pipeline_parallel_size > 1 (it is {pipeline_parallel_size})")
        if tensor_parallel_size > 1 or pipeline_parallel_size > 1:
            sizes = (tensor_parallel_size, pipeline_parallel_size, num_virtual_engines or pipeline_parallel_size)
            runners = _tensor_parallel_runners(path, num_workers, sizes, memory, block_size,
                                               resolve_dtype(dtype, device), device, attention_backend, swap,
                                               gemm_backend, compile_mode, rank_placement)
        else:
            runners = {
                f"worker-{i}": build_model_runner(
                    path, kv_cache_memory_bytes=memory, block_size=block_size,
                    dtype=getattr(torch, resolve_dtype(dtype, device)), device=device,
                    attention_backend=attention_backend, gemm_backend=gemm_backend, compile_mode=compile_mode,
                    swap_space_bytes=swap,
                )
                for i in range(num_workers)
            }
        self._runners = runners
        scheduler = Scheduler(config)
        for worker_id, runner in runners.items():
            scheduler.add_worker(worker_id, runner.num_blocks, runner.num_cpu_blocks)
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
        info = self.tokenizer.info
        check_prompt_length(len(ids), info.max_model_len, field_name)
        engine_params = params.to_engine(len(ids), info.max_model_len, info.vocab_size, info.eos_token_ids)
        return self.add_parsed(ParsedRequest(tuple(ids), params, engine_params), request_id)

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


def _tensor_parallel_runners(path: Path, num_workers: int, sizes: tuple[int, int, int], memory: int,
                             block_size: int, dtype: str, device: str, attention_backend: str, swap: int,
                             gemm_backend: str, compile_mode: str, rank_placement=None) -> dict:
    """``num_workers`` workers of ``sizes = (T, P, V)``: T*P ranks each, rank 0 here plus T*P-1 helper
    processes; with P > 1, V virtual engines each (worker ids ``worker-<i>/ve<v>`` when V > 1)."""
    from pagedserve.engine.parallel.launch import start_tensor_parallel_runner
    from pagedserve.engine.parallel.rank import RankConfig
    from pagedserve.engine.parallel.rank_link import LOCAL

    if gemm_backend != "torch" or compile_mode != "eager":
        raise ValueError("tensor_parallel_size or pipeline_parallel_size > 1 runs eager torch GEMMs only "
                         "(gemm_backend='torch', compile_mode='eager')")
    if num_workers > 1:  # rank 0 of each worker would need its own torch.distributed default group
        raise ValueError("tensor_parallel_size or pipeline_parallel_size > 1 takes one worker per process "
                         "(num_workers=1)")
    tensor_parallel_size, pipeline_parallel_size, engines = sizes
    config = RankConfig(str(path), memory, block_size, dtype, device, attention_backend, swap,
                        pipeline_parallel_size=pipeline_parallel_size, num_virtual_engines=engines)
    runner = start_tensor_parallel_runner(config, tensor_parallel_size, placement=rank_placement or LOCAL)
    if pipeline_parallel_size == 1:
        return {"worker-0": runner}
    views = runner.virtual_engines()
    return {"worker-0": views[0]} if len(views) == 1 else {f"worker-0/ve{i}": v for i, v in enumerate(views)}
