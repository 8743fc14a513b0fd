"""The coordinator's background tasks, in one place so that closing the cluster cancels them all."""

from __future__ import annotations

import asyncio


class Tasks:
    def __init__(self):
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` in the background, until it ends or `cancel_all`."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def shielded(self, coro):
        """Run `coro` as a background task and await it; cancelling the caller (a client gone)
        does not cancel it, so a drain or a scale is never left half done."""
        return await asyncio.shield(self.spawn(coro))

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
