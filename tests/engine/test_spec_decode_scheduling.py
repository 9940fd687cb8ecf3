"""The scheduler's side of speculative decoding, driven with hand-made answers: lookahead slots are
reserved for decodes only, the slots past the accepted drafts are freed when the answer comes (exact
block counts), accepted tokens end a sequence at the first stop, and a speculating sequence does not
run ahead of its answer."""

from __future__ import annotations

import pytest

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.messages import AcceptedDraft, EngineRequest, FinishReason, SampledToken, SequenceId, StepResult
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.counters import SpecDecodeCounters

BLOCKS, BLOCK_SIZE, EOS = 16, 4, 2
A = SequenceId("a")


def make_scheduler(k: int = 4, max_plans_in_flight: int = 1) -> Scheduler:
    config = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=64, max_plans_in_flight=max_plans_in_flight,
                             enable_prefix_caching=False)
    scheduler = Scheduler(config, SpeculativeConfig(method="ngram", num_speculative_tokens=k, control="fixed"))
    scheduler.add_worker("w0", BLOCKS)
    return scheduler


def add(scheduler: Scheduler, prompt_len: int = 6, max_tokens: int = 20) -> None:
    sampling = EngineSamplingParams(max_tokens=max_tokens, temperature=0.0, eos_token_ids=(EOS,))
    scheduler.add_request(EngineRequest("a", tuple(range(10, 10 + prompt_len)), sampling, 0.0))


def answer(scheduler: Scheduler, step_id: int, token: int, accepted: tuple[int, ...] = (), drafts: int = 0):
    sampled = SampledToken(A, token, 0.0, accepted=tuple(AcceptedDraft(t, 0.0) for t in accepted),
                           num_draft_tokens=drafts)
    return scheduler.update_from_output({"w0": StepResult(step_id, (sampled,))})


def free(scheduler: Scheduler) -> int:
    return scheduler.block_manager("w0").num_free_blocks


def test_decodes_reserve_lookahead_slots_and_rejected_ones_are_freed():
    scheduler = make_scheduler()
    add(scheduler)
    prefill = scheduler.schedule(["w0"]).plans["w0"]
    assert prefill.new_requests[0].num_scheduled_tokens == 6 and free(scheduler) == BLOCKS - 2
    answer(scheduler, prefill.step_id, 50)  # 7 tokens, 6 computed
    decode = scheduler.schedule(["w0"]).plans["w0"]
    (delta,) = decode.cached_requests
    assert (delta.num_computed_tokens, delta.num_scheduled_tokens, delta.num_lookahead_tokens) == (6, 1, 4)
    assert len(delta.new_block_ids) == 1 and free(scheduler) == BLOCKS - 3  # slots 0..10: 3 blocks
    answer(scheduler, decode.step_id, 51, drafts=4)  # every draft rejected: 8 tokens, 7 computed
    assert free(scheduler) == BLOCKS - 2 and scheduler.sequence(A).num_computed_tokens == 7
    decode = scheduler.schedule(["w0"]).plans["w0"]
    (delta,) = decode.cached_requests
    assert (delta.num_computed_tokens, delta.num_lookahead_tokens, len(delta.new_block_ids)) == (7, 4, 1)
    outputs = answer(scheduler, decode.step_id, 55, accepted=(52, 53, 54), drafts=4)  # 12 tokens, 11 computed
    assert outputs[0].new_token_ids == (52, 53, 54, 55) and outputs[0].first_output_index == 2
    assert scheduler.sequence(A).num_computed_tokens == 11 and free(scheduler) == BLOCKS - 3
    assert scheduler.stats().spec_decode == SpecDecodeCounters(2, 8, 3, (1, 1, 1, 0))  # k = 4 positions


def test_accepted_tokens_stop_at_eos_and_every_block_is_freed():
    scheduler = make_scheduler()
    add(scheduler)
    answer(scheduler, scheduler.schedule(["w0"]).plans["w0"].step_id, 50)
    decode = scheduler.schedule(["w0"]).plans["w0"]
    (output,) = answer(scheduler, decode.step_id, 60, accepted=(51, EOS, 53), drafts=4)
    assert output.new_token_ids == (51, EOS) and output.finish_reason is FinishReason.STOP
    assert free(scheduler) == BLOCKS and not scheduler.has_unfinished_requests()


def test_lookahead_leaves_room_for_the_bonus_token_within_max_tokens():
    scheduler = make_scheduler(k=4)
    add(scheduler, max_tokens=3)
    answer(scheduler, scheduler.schedule(["w0"]).plans["w0"].step_id, 50)
    decode = scheduler.schedule(["w0"]).plans["w0"]
    assert decode.cached_requests[0].num_lookahead_tokens == 1  # 2 more wanted: 1 draft + the bonus
    (output,) = answer(scheduler, decode.step_id, 52, accepted=(51,), drafts=1)
    assert output.new_token_ids == (51, 52) and output.finish_reason is FinishReason.LENGTH
    assert free(scheduler) == BLOCKS


def test_a_lookahead_that_does_not_fit_is_dropped_not_preempting():
    scheduler = make_scheduler(k=4)
    add(scheduler, prompt_len=BLOCKS * BLOCK_SIZE - 4, max_tokens=10)  # 15 blocks for the prompt
    plan = scheduler.schedule(["w0"]).plans["w0"]
    answer(scheduler, plan.step_id, 50)
    decode = scheduler.schedule(["w0"]).plans["w0"]
    (delta,) = decode.cached_requests
    assert delta.num_lookahead_tokens == 0 and scheduler.stats().num_preemptions == 0  # 1 + 4 slots: 2 blocks


@pytest.mark.parametrize("k, runs_ahead", [(0, True), (4, False)])
def test_a_speculating_sequence_waits_for_its_answer(k, runs_ahead):
    scheduler = Scheduler(SchedulerConfig(block_size=BLOCK_SIZE, max_plans_in_flight=2, enable_prefix_caching=False),
                          SpeculativeConfig(method="ngram", control="fixed") if k else SpeculativeConfig())
    scheduler.add_worker("w0", BLOCKS)
    add(scheduler)
    scheduler.schedule(["w0"])  # the prefill, its token in flight
    assert bool(scheduler.schedule(["w0"]).plans) is runs_ahead


def test_bad_speculative_configs_are_refused():
    for fields in ({"num_speculative_tokens": 0}, {"prompt_lookup_min": 0}, {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
                   {"method": "eagle"}):
        with pytest.raises(ValueError):
            SpeculativeConfig(**{"method": "ngram", **fields})


@pytest.mark.parametrize("fields", [{"num_speculative_tokens": 8}, {"control": "fixed"}, {"prompt_lookup_max": 3}])
def test_a_speculative_setting_without_a_method_is_refused_not_ignored(fields):
    name, value = next(iter(fields.items()))
    with pytest.raises(ValueError, match=f"{name}={value} has no effect without a speculative method"):
        SpeculativeConfig(**fields)
    assert SpeculativeConfig(method="none").num_lookahead_tokens == 0  # the defaults alone are no speculation


def test_the_step_cost_model_sees_a_speculative_decode_as_the_rows_it_verified(monkeypatch):
    """A decode with k lookahead slots takes ``1 + k`` rows of the token budget when planned; the cost
    model is fed the rows the worker verified (``1 + num_draft_tokens``), with their attention pairs."""
    from pagedserve.engine.step_cost import StepCostModel, StepShape, attention_pairs

    observed: list[StepShape] = []
    monkeypatch.setattr(StepCostModel, "observe", lambda self, shape, seconds: observed.append(shape))
    scheduler = make_scheduler()
    add(scheduler)
    prefill = scheduler.schedule(["w0"]).plans["w0"]
    answer(scheduler, prefill.step_id, 50)
    assert observed == [StepShape(6, attention_pairs(0, 6), 0)]
    decode = scheduler.schedule(["w0"]).plans["w0"]
    assert decode.cached_requests[0].num_lookahead_tokens == 4
    answer(scheduler, decode.step_id, 53, accepted=(51,), drafts=2)  # 2 of the 4 slots held drafts
    assert observed[1] == StepShape(3, attention_pairs(6, 3), 3)
    decode = scheduler.schedule(["w0"]).plans["w0"]
    answer(scheduler, decode.step_id, 54)  # the worker found nothing to draft: a plain decode's row
    assert observed[2] == StepShape(1, attention_pairs(8, 1), 1)


def test_counters_since_an_earlier_reading_are_the_difference_of_the_totals():
    """`bench throughput` subtracts the warm-up's counts from the totals it prints."""
    earlier = SpecDecodeCounters(2, 8, 3, (1, 1, 1, 0))
    later = earlier + SpecDecodeCounters(3, 9, 6, (3, 2, 1))
    assert later - earlier == SpecDecodeCounters(3, 9, 6, (3, 2, 1, 0))
    assert (later - earlier).mean_accepted_length == 3.0
