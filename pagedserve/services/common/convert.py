"""Conversions between the in-process dataclasses and their protobuf messages (proto/engine.proto).

Every message that crosses a process boundary goes through here, so each field is mapped once.
"""

from __future__ import annotations

from pagedserve.engine.messages import (
    BatchPlan,
    CachedRequestData,
    EngineRequest,
    FinishReason,
    NewRequestData,
    RequestError,
    SampledToken,
    SequenceId,
    StepResult,
)
from pagedserve.engine.outputs import OutputKind, RequestOutput
from pagedserve.services.common.convert_logprobs import (entries_from_pb, prompt_logprobs_from_pb,
                                                         prompt_logprobs_to_pb, token_logprobs_to_pb)
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb_fields import enum_from_pb, enum_to_pb, from_pb, to_pb
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.config import SchedulerStats

def sampling_to_pb(params: EngineSamplingParams) -> pb.EngineSamplingParams:
    """EngineSamplingParams -> pb.EngineSamplingParams, by field name (``pb_fields``)."""
    return to_pb(params, pb.EngineSamplingParams)


def sampling_from_pb(msg: pb.EngineSamplingParams) -> EngineSamplingParams:
    """pb.EngineSamplingParams -> EngineSamplingParams (unset optional fields: the defaults)."""
    return from_pb(msg, EngineSamplingParams)


def request_to_pb(request: EngineRequest, gateway_id: str) -> pb.QueuedRequest:
    """An EngineRequest as the Redis record, tagged with the gateway that waits for its tokens."""
    return pb.QueuedRequest(
        request_id=request.request_id,
        gateway_id=gateway_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=sampling_to_pb(request.sampling),
        arrival_time=request.arrival_time,
        trace_context=dict(request.trace_context),
        priority=request.priority,
        cache_salt=request.cache_salt,
    )


def request_from_pb(msg: pb.QueuedRequest) -> EngineRequest:
    """The Redis record -> EngineRequest (the gateway id is routing, not part of the request)."""
    return EngineRequest(
        request_id=msg.request_id,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        sampling=sampling_from_pb(msg.sampling_params),
        arrival_time=msg.arrival_time,
        trace_context=dict(msg.trace_context),
        priority=msg.priority,
        cache_salt=msg.cache_salt,
    )


def _seq_to_pb(seq_id: SequenceId) -> pb.SequenceId:
    return pb.SequenceId(request_id=seq_id.request_id, sample_index=seq_id.sample_index)


def _seq_from_pb(msg: pb.SequenceId) -> SequenceId:
    return SequenceId(msg.request_id, msg.sample_index)


def _copies_to_pb(pairs: tuple[tuple[int, int], ...]) -> list[pb.BlockCopy]:
    """``(source, target)`` block pairs -> repeated pb.BlockCopy."""
    return [pb.BlockCopy(source=source, target=target) for source, target in pairs]


def _copies_from_pb(copies) -> tuple[tuple[int, int], ...]:
    """repeated pb.BlockCopy -> ``(source, target)`` block pairs."""
    return tuple((c.source, c.target) for c in copies)


def plan_to_pb(plan: BatchPlan) -> pb.BatchPlan:
    """BatchPlan -> pb.BatchPlan (scheduler to worker); cached requests by field name (``pb_fields``)."""
    return pb.BatchPlan(
        step_id=plan.step_id,
        new_requests=[
            pb.NewRequest(
                seq_id=_seq_to_pb(r.seq_id),
                token_ids=r.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                sampling_params=sampling_to_pb(r.sampling),
                trace_context=dict(r.trace_context),
            )
            for r in plan.new_requests
        ],
        cached_requests=[to_pb(r, pb.CachedRequest) for r in plan.cached_requests],
        finished_seq_ids=[_seq_to_pb(s) for s in plan.finished_seq_ids],
        blocks_to_swap_out=_copies_to_pb(plan.blocks_to_swap_out),
        blocks_to_swap_in=_copies_to_pb(plan.blocks_to_swap_in),
        blocks_to_copy=_copies_to_pb(plan.blocks_to_copy),
        session_id=plan.session_id,
    )


def plan_from_pb(msg: pb.BatchPlan) -> BatchPlan:
    """pb.BatchPlan -> BatchPlan (in the worker)."""
    return BatchPlan(
        step_id=msg.step_id,
        new_requests=tuple(
            NewRequestData(
                seq_id=_seq_from_pb(r.seq_id),
                token_ids=tuple(r.token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                block_ids=tuple(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                sampling=sampling_from_pb(r.sampling_params),
                trace_context=dict(r.trace_context),
            )
            for r in msg.new_requests
        ),
        cached_requests=tuple(from_pb(r, CachedRequestData) for r in msg.cached_requests),
        finished_seq_ids=tuple(_seq_from_pb(s) for s in msg.finished_seq_ids),
        blocks_to_swap_out=_copies_from_pb(msg.blocks_to_swap_out),
        blocks_to_swap_in=_copies_from_pb(msg.blocks_to_swap_in),
        blocks_to_copy=_copies_from_pb(msg.blocks_to_copy),
        session_id=msg.session_id,
    )


def step_result_to_pb(result: StepResult) -> pb.StepResult:
    """StepResult -> pb.StepResult (worker to scheduler); sampled tokens by field name (``pb_fields``)."""
    return pb.StepResult(step_id=result.step_id, sampled=[to_pb(s, pb.SampledToken) for s in result.sampled],
                         prompt_logprobs=[prompt_logprobs_to_pb(c) for c in result.prompt_logprobs])


def step_result_from_pb(msg: pb.StepResult) -> StepResult:
    """pb.StepResult -> StepResult (in the scheduler)."""
    return StepResult(
        step_id=msg.step_id,
        sampled=tuple(from_pb(s, SampledToken) for s in msg.sampled),
        prompt_logprobs=tuple(prompt_logprobs_from_pb(c) for c in msg.prompt_logprobs),
    )


def output_to_pb(output: RequestOutput) -> pb.TokenEvent:
    """RequestOutput -> pb.TokenEvent (scheduler to gateway)."""
    event = pb.TokenEvent(
        request_id=output.request_id,
        kind=enum_to_pb(output.kind, pb.TokenEventKind.DESCRIPTOR),
        first_output_index=output.first_output_index,
        token_ids=output.new_token_ids,
        sample_index=output.sample_index,
        logprobs=[token_logprobs_to_pb(e) for e in output.logprobs],
    )
    if output.prompt_logprobs is not None:
        event.prompt_logprobs.first_position = 1
        event.prompt_logprobs.entries.extend(token_logprobs_to_pb(e) for e in output.prompt_logprobs)
    if output.stop_token_id is not None:
        event.stop_token_id = output.stop_token_id
    if output.finish_reason is not None:
        event.finish_reason = enum_to_pb(output.finish_reason, pb.FinishReason.DESCRIPTOR)
    if output.error is not None:
        event.error.kind = enum_to_pb(output.error.kind, pb.ErrorKind.DESCRIPTOR)
        event.error.message = output.error.message
    return event


def output_from_pb(event: pb.TokenEvent) -> RequestOutput:
    """pb.TokenEvent -> RequestOutput (in the gateway)."""
    return RequestOutput(
        request_id=event.request_id,
        kind=enum_from_pb(event.kind, pb.TokenEventKind.DESCRIPTOR, OutputKind) or OutputKind.TOKENS,
        first_output_index=event.first_output_index,
        new_token_ids=tuple(event.token_ids),
        finish_reason=enum_from_pb(event.finish_reason, pb.FinishReason.DESCRIPTOR, FinishReason),
        error=_error_from_pb(event.error) if event.HasField("error") else None,
        sample_index=event.sample_index,
        logprobs=entries_from_pb(event.logprobs),
        prompt_logprobs=entries_from_pb(event.prompt_logprobs.entries) if event.HasField("prompt_logprobs") else None,
        stop_token_id=event.stop_token_id if event.HasField("stop_token_id") else None,
    )


def _error_from_pb(msg: pb.RequestError) -> RequestError:
    """An error of a kind this side does not know (a newer scheduler's) reads as UNAVAILABLE."""
    kind = enum_from_pb(msg.kind, pb.ErrorKind.DESCRIPTOR, ErrorKind) or ErrorKind.UNAVAILABLE
    return RequestError(kind, msg.message)


def stats_to_pb(stats: SchedulerStats) -> pb.SchedulerStats:
    """SchedulerStats -> pb.SchedulerStats (GetStats)."""
    return to_pb(stats, pb.SchedulerStats)


def stats_from_pb(msg: pb.SchedulerStats) -> SchedulerStats:
    """pb.SchedulerStats -> SchedulerStats (clients of GetStats: the gateway's cluster view)."""
    return from_pb(msg, SchedulerStats)
