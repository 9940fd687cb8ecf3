"""Every field survives the trip dataclass -> protobuf -> dataclass."""

import dataclasses

from pagedserve.services.common import convert
from pagedserve.engine.messages import (BatchPlan, CachedRequestData, EngineRequest, FinishReason, NewRequestData,
                                        RequestError, SampledToken, SequenceId, StepResult)
from pagedserve.engine.outputs import OutputKind, RequestOutput
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.config import SchedulerStats, WorkerStats
from pagedserve.engine.spec_decode.counters import SpecDecodeCounters

SAMPLING = EngineSamplingParams(max_tokens=9, temperature=0.5, top_p=0.75, top_k=7, min_p=0.125, seed=42,
                                min_tokens=2, stop_token_ids=(5, 6), ignore_eos=True, eos_token_ids=(2,), n=3)


def test_request_round_trip():
    request = EngineRequest("r", (1, 2, 3), SAMPLING, 12.5, {"traceparent": "00-ab"}, priority=-3, cache_salt="s")
    assert convert.request_from_pb(convert.request_to_pb(request, "g")) == request
    assert convert.request_to_pb(request, "g").gateway_id == "g"


def test_unseeded_sampling_stays_unseeded():
    params = EngineSamplingParams(max_tokens=1)
    assert convert.sampling_from_pb(convert.sampling_to_pb(params)) == params


def test_plan_round_trip():
    plan = BatchPlan(
        step_id=7,
        new_requests=(NewRequestData(SequenceId("a", 2), (1, 2), 1, (4, 5), 1, 1, SAMPLING, {"k": "v"}),),
        cached_requests=(CachedRequestData(SequenceId("b"), (9,), 16, 1),),
        finished_seq_ids=(SequenceId("c"), SequenceId("c", 3)),
        blocks_to_swap_out=((1, 2),),
        blocks_to_swap_in=((3, 4), (5, 6)),
        blocks_to_copy=((7, 8),),
        session_id="s1",
    )
    assert convert.plan_from_pb(convert.plan_to_pb(plan)) == plan


def test_results_outputs_and_stats_round_trip():
    result = StepResult(3, (SampledToken(SequenceId("a", 0), 11, -0.5, 2),))
    assert convert.step_result_from_pb(convert.step_result_to_pb(result)) == result
    output = RequestOutput(request_id="a", first_output_index=4, new_token_ids=(11,),
                           finish_reason=FinishReason.LENGTH, error=RequestError(ErrorKind.RESOURCE_EXHAUSTED, "too big"), sample_index=2)
    assert convert.output_from_pb(convert.output_to_pb(output)) == output
    for kind in OutputKind:
        assert convert.output_from_pb(convert.output_to_pb(RequestOutput(request_id="a", kind=kind))).kind is kind
    stats = SchedulerStats(1, 2, 3, 4, (WorkerStats("w", 10, 5, 2, 1, 3),), 1, 2, 100, 40)
    assert convert.stats_from_pb(convert.stats_to_pb(stats)) == stats
    assert not convert.stats_to_pb(stats).HasField("spec_decode")  # this scheduler does not speculate
    speculating = dataclasses.replace(stats, spec_decode=SpecDecodeCounters(5, 17, 9, (5, 3, 1, 0)))
    assert convert.stats_from_pb(convert.stats_to_pb(speculating)) == speculating


def test_sampling_logprobs_and_stop_reason_round_trip():
    from pagedserve.engine.messages import PromptLogprobs, TokenLogprobs
    from pagedserve.services.common.convert import (output_from_pb, output_to_pb, sampling_from_pb, sampling_to_pb,
                                                    step_result_from_pb, step_result_to_pb)

    params = EngineSamplingParams(max_tokens=5, logprobs=3, prompt_logprobs=0, presence_penalty=0.5,
                                  frequency_penalty=-1.0, repetition_penalty=1.25, logit_bias=((3, 2.5), (9, -100.0)))
    assert sampling_from_pb(sampling_to_pb(params)) == params
    plain = EngineSamplingParams(max_tokens=5)
    assert sampling_from_pb(sampling_to_pb(plain)) == plain
    entry = TokenLogprobs(7, -0.5, 2, (4, 7), (-0.25, -0.5))
    seq = SequenceId("r", 0)
    result = StepResult(3, (SampledToken(seq, 7, -0.5, 0, entry), SampledToken(SequenceId("q"), 1, 0.0)),
                        (PromptLogprobs(seq, 1, (entry,)),))
    assert step_result_from_pb(step_result_to_pb(result)) == result
    output = RequestOutput(request_id="r", new_token_ids=(7,), finish_reason=FinishReason.STOP, logprobs=(entry,),
                           prompt_logprobs=(entry,), stop_token_id=7)
    assert output_from_pb(output_to_pb(output)) == output
    bare = RequestOutput(request_id="r", first_output_index=1, new_token_ids=(8,))
    assert output_from_pb(output_to_pb(bare)) == bare


def test_speculative_fields_survive_the_plan_and_the_result():
    """What speculative decoding sends across: the lookahead slots of a cached request, and the
    accepted drafts (with their logprobs when asked) and the count of verified drafts of a sampled token."""
    from pagedserve.engine.messages import AcceptedDraft, TokenLogprobs

    plan = BatchPlan(step_id=2, cached_requests=(CachedRequestData(SequenceId("a", 1), (), 40, 1, 4),
                                                 CachedRequestData(SequenceId("b"), (5,), 16, 1)))
    message = convert.plan_to_pb(plan)
    assert [r.num_lookahead_tokens for r in message.cached_requests] == [4, 0]
    assert convert.plan_from_pb(message) == plan
    entry = TokenLogprobs(7, -0.5, 1, (7, 4), (-0.5, -1.25))
    accepted = (AcceptedDraft(7, -0.5, entry), AcceptedDraft(8, -0.75))
    drafted = SampledToken(SequenceId("a", 1), 9, -0.25, 1, entry, accepted=accepted, num_draft_tokens=3)
    rejected = SampledToken(SequenceId("b"), 3, 0.0, num_draft_tokens=2)
    result = StepResult(2, (drafted, rejected))
    message = convert.step_result_to_pb(result)
    assert [d.token_id for d in message.sampled[0].accepted] == [7, 8]
    first, second = message.sampled[0].accepted
    assert first.HasField("logprobs") and not second.HasField("logprobs")
    assert convert.step_result_from_pb(message) == result


def left_at_default(obj) -> list[str]:
    """The fields of the dataclass ``obj`` still at their default: a round trip does not show they travel."""
    left = []
    for f in dataclasses.fields(obj):
        if f.default is not dataclasses.MISSING and getattr(obj, f.name) == f.default:
            left.append(f.name)
        elif f.default_factory is not dataclasses.MISSING and getattr(obj, f.name) == f.default_factory():
            left.append(f.name)
    return left


def test_every_field_of_every_hand_mapped_message_travels():
    """The converters that copy fields by hand (convert.py, convert_logprobs.py): each message built with every
    field away from its default survives the round trip, so a field added to a dataclass and not to its
    converter fails here (a round trip of defaults passes whatever the converter drops)."""
    from pagedserve.engine.messages import AcceptedDraft, PromptLogprobs, TokenLogprobs

    entry = TokenLogprobs(7, -0.5, 2, (4, 7), (-0.25, -0.5))
    seq = SequenceId("r", 1)
    request = EngineRequest("r", (1, 2, 3), SAMPLING, 12.5, {"traceparent": "00-ab"}, priority=-3, cache_salt="s")
    new = NewRequestData(seq, (1, 2), 1, (4, 5), 1, 1, SAMPLING, {"k": "v"})
    cached = CachedRequestData(seq, (9,), 16, 1, 3)
    plan = BatchPlan(7, (new,), (cached,), (SequenceId("c", 3),), ((1, 2),), ((3, 4),), ((7, 8),), "s1")
    sampled = SampledToken(seq, 7, -0.5, 1, entry, "not the schema's", (AcceptedDraft(5, -0.25, entry),), 2)
    result = StepResult(3, (sampled,), (PromptLogprobs(seq, 1, (entry,)),))
    output = RequestOutput(request_id="r", kind=OutputKind.TAKEN, first_output_index=4, new_token_ids=(7,),
                           finish_reason=FinishReason.STOP, error=RequestError(ErrorKind.RESOURCE_EXHAUSTED, "big"),
                           sample_index=1, logprobs=(entry,), prompt_logprobs=(entry,), stop_token_id=7)
    stats = SchedulerStats(1, 2, 3, 4, (WorkerStats("w", 10, 5, 2, 1, 3, 256),), 1, 2, 100, 40,
                           SpecDecodeCounters(5, 17, 9, (5, 3, 1, 0)))
    for message in (request, new, cached, plan, sampled, result, output, stats, stats.workers[0], entry):
        assert left_at_default(message) == [], type(message).__name__
    assert convert.request_from_pb(convert.request_to_pb(request, "g")) == request
    assert convert.plan_from_pb(convert.plan_to_pb(plan)) == plan
    assert convert.step_result_from_pb(convert.step_result_to_pb(result)) == result
    assert convert.output_from_pb(convert.output_to_pb(output)) == output
    assert convert.stats_from_pb(convert.stats_to_pb(stats)) == stats
