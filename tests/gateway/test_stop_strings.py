"""StopStringMatcher: matches across deltas, cuts at the first match, never leaks part of a stop."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.text.request_samples import RequestSamples
from pagedserve.text.stop_strings import StopCheck, StopStringMatcher, StopStrings


def run(stops, include, deltas) -> tuple[list[str], StopCheck | None]:
    """Feeds deltas until a stop matches; returns the emitted pieces (flush last) and the final check."""
    matcher = StopStringMatcher(stops, include)
    pieces = []
    for delta in deltas:
        check = matcher.feed(delta)
        pieces.append(check.text)
        if check.stopped:
            return pieces, check
    pieces.append(matcher.flush())
    return pieces, None


def reference(stops, include, text) -> tuple[str, str]:
    """The expected output and matched stop, computed on the whole text at once by brute force."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, ""


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([], False)
    assert matcher.feed("abc") == StopCheck("abc")
    assert matcher.flush() == ""


def test_stop_inside_one_delta_is_cut() -> None:
    pieces, check = run(["###"], False, ["Hello ### world"])
    assert pieces == ["Hello "] and check == StopCheck("Hello ", stopped=True, stop="###")


def test_stop_inside_one_delta_is_kept_when_included() -> None:
    pieces, check = run(["###"], True, ["Hello ### world"])
    assert pieces == ["Hello ###"] and check.stop == "###"


def test_stop_spanning_deltas_never_leaks() -> None:
    pieces, check = run(["</answer>"], False, ["42 </", "ans", "wer> and more"])
    assert pieces == ["42 ", "", ""]
    assert check.stopped and check.stop == "</answer>"


def test_stop_spanning_deltas_included() -> None:
    pieces, _ = run(["</answer>"], True, ["42 </", "ans", "wer> and more"])
    assert "".join(pieces) == "42 </answer>"


def test_false_start_is_released() -> None:
    matcher = StopStringMatcher(["STOP"], False)
    assert matcher.feed("go ST").text == "go "
    assert matcher.feed("OR").text == "STOR"  # "STOR" cannot begin "STOP"
    assert matcher.feed("ST").text == ""
    assert matcher.flush() == "ST"


def test_only_possible_beginnings_are_held() -> None:
    matcher = StopStringMatcher(["abc"], False)
    assert matcher.feed("xyz").text == "xyz"
    assert matcher.feed("ab").text == ""
    assert matcher.feed("x").text == "abx"


def test_first_of_several_stops_wins() -> None:
    pieces, check = run(["world", "lo"], False, ["Hello world"])
    assert pieces == ["Hel"] and check.stop == "lo"


def test_stop_completed_first_wins_whatever_the_split() -> None:
    # "xyz" starts first but "y" is complete first: streamed or whole, the cut is the same.
    assert run(["xyz", "y"], False, ["xyz"])[0] == ["x"]
    assert run(["xyz", "y"], False, ["x", "y", "z"])[0] == ["", "x"]


def test_longest_stop_wins_a_tie() -> None:
    _, check = run(["b", "ab"], False, ["zab"])
    assert check.stop == "ab"


def test_after_a_match_everything_is_ignored() -> None:
    matcher = StopStringMatcher(["."], False)
    assert matcher.feed("a.b").text == "a"
    assert matcher.feed("more") == StopCheck("", stopped=True, stop=".")
    assert matcher.flush() == ""
    assert matcher.stopped


def test_unicode_stop_strings() -> None:
    pieces, check = run(["世界", "😀"], False, ["你好世", "界!"])
    assert "".join(pieces) == "你好" and check.stop == "世界"


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""], False)


ALPHABET = "abc世😀"


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    deltas=st.lists(st.text(ALPHABET, max_size=6), max_size=8),
    include=st.booleans(),
)
def test_matches_whole_text_reference_and_never_leaks(stops, deltas, include) -> None:
    pieces, check = run(stops, include, deltas)
    expected, stop = reference(stops, include, "".join(deltas))
    assert "".join(pieces) == expected
    assert (check.stop if check else "") == stop
    if not include:
        emitted = ""
        for piece in pieces:  # no emitted text, at any time, contains a stop string
            emitted += piece
            assert not any(s in emitted for s in stops)


def test_failure_links_find_a_stop_inside_a_false_start() -> None:
    assert run(["abcx", "bcd"], False, ["ab", "cd!"]) == (["", "a"], StopCheck("a", stopped=True, stop="bcd"))
    assert run(["abcd", "bc"], True, ["abce"])[0] == ["abc"]


def test_one_automaton_serves_many_matchers() -> None:
    stops = StopStrings(["END", "halt"])
    first, second = StopStringMatcher(stops, False), StopStringMatcher(stops, True)
    assert first.feed("go EN").text == "go "
    assert second.feed("stop halting").text == "stop halt"
    assert first.feed("D").stopped and first.flush() == ""


def test_long_stop_string_with_many_samples_is_cheap(prompt_tokenizer) -> None:
    # Issue #9: an 8,000-character stop string with n=64 took 1.5 GB and 9 s in the gateway.
    stop = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(8000))
    params = SamplingParams(stop=(stop, stop[:4000] + "!"), n=64)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        samples = RequestSamples(prompt_tokenizer, [1, 2, 3], params)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(samples.samples) == 64
    assert elapsed < 1.0, f"{elapsed:.2f} s"
    assert peak < 50 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_long_held_back_tail_costs_linear_time() -> None:
    stop = "a" * 7999 + "b"
    matcher = StopStringMatcher([stop, "x" * 5000], False)
    started = time.perf_counter()
    emitted = [matcher.feed("a").text for _ in range(7000)]
    assert not any(emitted)  # all 7,000 characters could still begin the stop string
    assert matcher.feed("c").text == "a" * 7000 + "c"
    assert matcher.feed("a" * 7999 + "b").stopped
    assert time.perf_counter() - started < 1.0
