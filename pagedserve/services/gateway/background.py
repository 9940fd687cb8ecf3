"""Calls the gateway makes without waiting for their answers: Aborts and Resumes to schedulers, a
stream entry's deletion. One owner (``OutputRouter.background``) keeps them, so that a shutdown can let
them end before it closes the scheduler links and the Redis pool."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


class BackgroundCalls:
    """The running calls; asyncio keeps only a weak reference to a task, this set a strong one."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def start(self, coroutine: Coroutine) -> None:
        """Runs ``coroutine`` without waiting for it (safe while the caller is being cancelled)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    async def settle(self, timeout_s: float) -> int:
        """Waits up to ``timeout_s`` seconds for the running calls and those they start; returns how
        many are still running then (they end with the event loop)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._tasks and (left := deadline - asyncio.get_running_loop().time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)
        return len(self._tasks)
