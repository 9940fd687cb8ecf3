"""The n-gram proposer drafts what followed the latest earlier occurrence of the longest matching
suffix, within its limits."""

import pytest

from pagedserve.engine.spec_decode.ngram_proposer import NgramProposer


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
