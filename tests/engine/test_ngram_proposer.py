"""The n-gram proposer drafts what followed the latest earlier occurrence of the longest matching
suffix, within its limits; a structured output's drafts start with the tokens its grammar forces."""

import json
from types import SimpleNamespace

import pytest

from pagedserve.engine.grammar_matchers import grammar_compiler_for
from pagedserve.engine.spec_decode.ngram_proposer import NgramProposer
from pagedserve.engine.structured_output import StructuredOutput, StructureKind


def test_proposes_what_followed_the_suffix_earlier():
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert NgramProposer(3, 1, 3).draft(tokens) == [8, 9, 1]


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    tokens = [1, 2, 3, 40, 41, 9, 3, 50, 1, 2, 3]  # "3" alone last occurred before 50; "1 2 3" before 40
    assert NgramProposer(2, 1, 3).draft(tokens) == [40, 41]
    assert NgramProposer(2, 1, 1).draft(tokens) == [50, 1]


def test_the_latest_occurrence_wins_and_drafts_stop_at_the_end():
    tokens = [7, 1, 7, 2, 7]
    assert NgramProposer(4, 1, 2).draft(tokens) == [2, 7]


def test_no_match_and_limits_give_fewer_drafts():
    assert NgramProposer(3).draft([1, 2, 3, 4]) == []
    assert NgramProposer(3).draft([1]) == []
    assert NgramProposer(5, 1, 2).draft([1, 2, 3, 1, 2], limit=1) == [3]
    assert NgramProposer(5, 1, 2).draft([1, 2, 3, 1, 2], limit=0) == []


def test_bad_bounds_are_refused():
    for args in [(0,), (3, 0, 2), (3, 3, 2)]:
        with pytest.raises(ValueError):
            NgramProposer(*args)


@pytest.mark.model  # its tokenizer
def test_a_structured_outputs_drafts_start_with_what_its_grammar_forces(default_model, tokenizer):
    # after '{"a":1,"' the schema forces the next required key, and the lookup goes on after it; where the
    # grammar forces nothing (the integer after '{"a":') the lookup alone drafts
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "bb_key", "c"],
              "properties": {"a": {"type": "integer"}, "bb_key": {"type": "integer"}, "c": {"type": "string"}}}
    spec, compiler = StructuredOutput(StructureKind.JSON, json.dumps(schema)), grammar_compiler_for(default_model)
    proposer = NgramProposer(4, 1, 3)

    def proposal(text: str) -> tuple[list[int], list[int], list[int]]:
        written = tokenizer.encode_prompt_without_special_tokens(text)
        history = [*written, 7, 8, 9, *written]  # the lookup alone drafts 7, 8, 9 and what follows
        request = SimpleNamespace(state=SimpleNamespace(token_ids=history, matcher=compiler.matcher(spec, written)),
                                  num_lookahead_tokens=4)
        return list(proposer.propose([request], sampler=None)[0].token_ids), written, history

    drafts, written, history = proposal('{"a":1,"')
    forced = list(compiler.matcher(spec, written).compute_ff_tokens())
    assert tokenizer.decode(forced, True).startswith("bb_key") and drafts[:len(forced)] == forced
    assert drafts == (forced + proposer.draft([*history, *forced], limit=4 - len(forced)))[:4]
    drafts, _, history = proposal('{"a":')
    assert drafts == proposer.draft(history, limit=4) == [7, 8, 9, history[0]]
