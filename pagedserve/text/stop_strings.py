"""Stop strings over streamed text: cut the output where one first appears, leak none of it.

Text arrives in deltas, and a stop string may span several of them. The matcher holds back the
longest tail of the unemitted text that is the beginning of some stop string (at most
``max(len(s)) - 1`` characters), so text is emitted only once no stop string can start in it.

Which match wins does not depend on how the text was split into deltas: it is the stop string
that is complete first, reading the text from the left (the one ending earliest), and among those
ending at the same place, the longest (the one starting earliest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    """The result of feeding one text delta.

    Attributes:
        text: text to emit now (``""`` when everything is held back).
        stopped: a stop string matched; ``text`` ends where the output ends.
        stop: the stop string that matched; ``""`` unless ``stopped``.
    """

    text: str
    stopped: bool = False
    stop: str = ""


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas.

    Args:
        stop: the stop strings, each non-empty (an empty list passes all text through at once).
        include_stop_str_in_output: keep the matched stop string at the end of the text instead
            of cutting it.

    Raises:
        ValueError: an empty stop string.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._held = ""
        self._stopped = False
        self._matched = ""

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched (later deltas are then ignored)."""
        return self._stopped

    def feed(self, text_delta: str) -> StopCheck:
        """Takes the next piece of text and returns what may be emitted now.

        After a match, every later call returns no text, with ``stopped`` and the same ``stop``.
        """
        if self._stopped:
            return StopCheck(text="", stopped=True, stop=self._matched)
        text = self._held + text_delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self._stopped = True
            self._matched = stop
            self._held = ""
            end = start + len(stop) if self._include else start
            return StopCheck(text=text[:end], stopped=True, stop=stop)
        keep = self._held_tail_length(text)
        self._held = text[len(text) - keep :]
        return StopCheck(text=text[: len(text) - keep])

    def flush(self) -> str:
        """Returns the held-back text at the end of the stream (``""`` after a match)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """The (start, stop string) of the match that ends first, longest on a tie; None if none."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _held_tail_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string (0 if none)."""
        for k in range(min(self._max_hold, len(text)), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0
