"""``RequestOutput.emitted`` builds its output without the generated ``__init__`` (engine/outputs.py): what it
makes must be the output ``__init__`` makes from the same fields, as frozen, with every field readable."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagedserve.engine.messages import AcceptedDraft, FinishReason, SampledToken, SequenceId, TokenLogprobs
from pagedserve.engine.outputs import OutputKind, RequestOutput

SEQ = SequenceId("req", 1)
LOGPROBS = TokenLogprobs(7, -0.25, 1, (7, 9), (-0.25, -1.5))


def by_init(tokens, **fields) -> RequestOutput:
    return RequestOutput(request_id="req", first_output_index=4, sample_index=1,
                         new_token_ids=tuple(t.token_id for t in tokens),
                         logprobs=tuple(t.logprobs for t in tokens if t.logprobs is not None), **fields)


@pytest.mark.parametrize("tokens", [
    (SampledToken(SEQ, 7, -0.25),),
    (SampledToken(SEQ, 7, -0.25, logprobs=LOGPROBS),),
    (AcceptedDraft(11, -0.5, LOGPROBS), AcceptedDraft(12, -0.75, LOGPROBS), SampledToken(SEQ, 7, -0.25, LOGPROBS)),
    (AcceptedDraft(11, -0.5), SampledToken(SEQ, 7, -0.25)),
], ids=["one token", "one token with logprobs", "drafts with logprobs", "drafts"])
@pytest.mark.parametrize("finish", [(None, None), (FinishReason.STOP, 7), (FinishReason.LENGTH, None)],
                         ids=["running", "stop token", "length"])
def test_emitted_equals_the_output_init_makes(tokens, finish):
    reason, stop_token_id = finish
    prompt_logprobs = (LOGPROBS,) if reason is None else None
    output = RequestOutput.emitted("req", 1, 4, tokens, reason, stop_token_id, prompt_logprobs)
    expected = by_init(tokens, finish_reason=reason, stop_token_id=stop_token_id, prompt_logprobs=prompt_logprobs)
    assert output == expected
    assert dataclasses.astuple(output) == dataclasses.astuple(expected)  # every field, read one by one
    assert repr(output) == repr(expected)
    assert pickle.loads(pickle.dumps(output)) == expected
    assert dataclasses.replace(output, sample_index=0).sample_index == 0
    assert output.kind is OutputKind.TOKENS and output.error is None
    assert output.finished is (reason is not None)


def test_emitted_output_is_frozen():
    output = RequestOutput.emitted("req", 0, 0, (SampledToken(SEQ, 7, -0.25),), None, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        output.finish_reason = FinishReason.STOP  # type: ignore[misc]


def test_every_field_emitted_leaves_out_has_a_class_level_default():
    """A field ``emitted`` does not set is read from the class: a ``default_factory`` would leave none."""
    output = RequestOutput.emitted("req", 0, 0, (SampledToken(SEQ, 7, -0.25),), None, None, None)
    left_out = [f.name for f in dataclasses.fields(RequestOutput) if f.name not in vars(output)]
    assert left_out == ["kind", "error"]
    assert all(hasattr(RequestOutput, name) for name in left_out)
