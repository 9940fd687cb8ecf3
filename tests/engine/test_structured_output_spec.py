"""Structured-output specs refused before they are queued, a grammar that refuses a token ending
only its own sequence (with EOS) instead of failing the step, and the masks along a sequence's drafts."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.engine.grammar_matchers import advance, allows, draft_masks, grammar_compiler_for, mask_grammar
from pagedserve.engine.request_errors import InvalidRequestError
from pagedserve.engine.sampling_params import CONFLICTS_WITH_STRUCTURE, SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.engine.token_bitmask import apply_bitmask

YES_NO = StructuredOutput(StructureKind.CHOICE, choices=("yes", "no"))


def nested_schema(depth: int) -> str:
    return '{"type":"object","required":["a"],"properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth


@pytest.mark.parametrize("depth", [300, 1200])
def test_a_schema_nested_too_deeply_is_refused_not_crashed(depth):
    # json.loads and jsonschema recurse: 1,200 levels raised RecursionError (an INTERNAL error) before
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_output=StructuredOutput(StructureKind.JSON, spec=nested_schema(depth)))
    assert err.value.field_name == "structured_output.json" and "nested too deeply" in err.value.reason


@pytest.mark.parametrize(("name", "value"), [("allowed_token_ids", (5, 6)), ("bad_words", ("no",)), ("min_tokens", 2)])
def test_fields_that_could_mask_every_allowed_token_are_refused(name, value):
    assert name in CONFLICTS_WITH_STRUCTURE
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_output=YES_NO, **{name: value})
    assert err.value.field_name == name


def test_a_refused_token_leaves_only_eos_allowed(default_model):
    compiler = grammar_compiler_for(default_model)
    matcher = compiler.matcher(YES_NO)
    advance(matcher, 0)  # id 0 is not "yes" or "no": refused, and no exception
    assert matcher.is_error()
    logits = torch.zeros(2, compiler.vocab_size)
    mask_grammar(logits, [None, matcher])
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == sorted(compiler.eos_token_ids)


def test_a_replayed_output_that_does_not_match_ends_with_eos(default_model):
    compiler = grammar_compiler_for(default_model)
    matcher = compiler.matcher(YES_NO, output_token_ids=[0, 0])  # a resumed output that is not a choice
    logits = torch.zeros(1, compiler.vocab_size)
    mask_grammar(logits, [matcher])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted(compiler.eos_token_ids)


def mask_of(matcher, vocab_size: int) -> torch.Tensor:
    logits = torch.zeros(1, vocab_size)
    mask_grammar(logits, [matcher])
    return torch.isfinite(logits[0])


def allowed_by(bitmask: torch.Tensor, vocab_size: int) -> list[torch.Tensor]:
    logits = torch.zeros(bitmask.shape[0], vocab_size)
    apply_bitmask(logits, bitmask)
    return list(torch.isfinite(logits))


def test_draft_masks_follow_the_drafts_on_a_copy_and_stop_at_a_refused_one(default_model):
    compiler = grammar_compiler_for(default_model)
    matcher, vocab = compiler.matcher(YES_NO), compiler.vocab_size
    before = mask_of(matcher, vocab)
    first = int(before.nonzero()[0])                                       # a token that may start "yes" or "no"
    after = compiler.matcher(YES_NO, output_token_ids=[first])
    refused = int((~mask_of(after, vocab)).nonzero()[0])
    masks = draft_masks(matcher, (first, refused, first), vocab)
    assert masks.failures == (None, None, None, None)
    rows = allowed_by(masks.bitmask, vocab)
    assert torch.equal(rows[0], before) and torch.equal(rows[1], mask_of(after, vocab))
    assert allows(masks.bitmask[0], first) and not allows(masks.bitmask[1], refused)
    assert rows[2].all() and rows[3].all()                                  # past the refused draft: never reached
    assert torch.equal(mask_of(matcher, vocab), before)                     # the matcher itself did not move


def test_draft_masks_of_a_failed_matcher_carry_its_failure_from_the_first_row(default_model):
    compiler = grammar_compiler_for(default_model)
    matcher = compiler.matcher(YES_NO)
    advance(matcher, 0)
    masks = draft_masks(matcher, (0, 0), compiler.vocab_size)
    assert masks.failures[0] is not None and masks.failures[1:] == (None, None)
    rows = allowed_by(masks.bitmask, compiler.vocab_size)
    assert rows[0].nonzero().flatten().tolist() == sorted(compiler.eos_token_ids) and rows[1].all()


def test_a_draft_past_the_parser_limit_fails_the_next_row_quietly(default_model, tokenizer, caplog):
    # a schema past llguidance's parser limit fails at its first key: the walk's copy fails there, the row
    # after it carries the failure, and the warning of a failed sequence waits for the token to be accepted
    wide = {"type": "object", "properties": {f"key_{i}": {"type": "integer"} for i in range(600)},
            "additionalProperties": False}
    compiler = grammar_compiler_for(default_model)
    matcher = compiler.matcher(StructuredOutput(StructureKind.JSON, json.dumps(wide)))
    drafts = tokenizer.encode_prompt_without_special_tokens('{"key_0": 1}')[:3]
    with caplog.at_level("WARNING", logger="pagedserve.worker"):
        masks = draft_masks(matcher, drafts, compiler.vocab_size)
    assert [f is not None for f in masks.failures] == [False, True, False, False]
    assert "max is 2000" in masks.failures[1] and matcher.is_error() is False and not caplog.records


@pytest.mark.parametrize("meta", ["http://json-schema.org/draft-07/schema#", None])
def test_a_schema_is_checked_against_its_draft(meta):
    head = {} if meta is None else {"$schema": meta}
    SamplingParams(structured_output=StructuredOutput(StructureKind.JSON, json.dumps({**head, "type": "object"})))
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_output=StructuredOutput(StructureKind.JSON, json.dumps(
            {**head, "properties": {"a": {"minimum": "x"}}})))
    assert err.value.field_name == "structured_output.json"
    assert "not a valid JSON schema" in err.value.reason and "properties/a/minimum" in err.value.reason


def test_a_schema_naming_an_unknown_draft_is_refused_not_fetched():
    spec = json.dumps({"$schema": "http://10.255.255.1/meta", "type": "object"})
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_output=StructuredOutput(StructureKind.JSON, spec))
    assert "$schema 'http://10.255.255.1/meta'" in err.value.reason and "not supported" in err.value.reason
