"""Timing every call of one function from outside it, for the benchmarks: no instrumentation stays
in the hot path."""

from __future__ import annotations

import time
from collections.abc import Callable


class CallTimer:
    """While entered, ``getattr(owner, name)`` is replaced by a wrapper that records each call's
    size and wall time; the original is put back on exit.

    Args:
        owner: the module or class whose attribute is called (a module that imported the function
            by name holds its own reference: time it there).
        name: the attribute.
        size: what a call's arguments count (rows, matchers), recorded beside its time; by default 1.

    Attributes:
        calls: ``(size, seconds)`` of every call, in order (appended from any thread).
    """

    def __init__(self, owner: object, name: str, size: Callable[..., int] = lambda *args, **kwargs: 1) -> None:
        self.owner, self.name, self.size = owner, name, size
        self.calls: list[tuple[int, float]] = []

    def __enter__(self) -> CallTimer:
        original = self._original = getattr(self.owner, self.name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.calls.append((self.size(*args, **kwargs), elapsed))

        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc_info: object) -> None:
        setattr(self.owner, self.name, self._original)

    @property
    def total_s(self) -> float:
        """Seconds spent in all calls."""
        return sum(seconds for _, seconds in self.calls)
