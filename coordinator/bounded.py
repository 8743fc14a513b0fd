"""`bounded(awaitable, timeout_s)`: every bounded wait in the coordinator goes through it.

It is `asyncio.timeout` around one await, in the waiting task itself. It replaces
`asyncio.wait_for`, which on Python 3.11 runs the awaitable in a task of its own and can lose a
cancellation: if the waiter is cancelled in the same loop turn as the awaited thing completes,
`wait_for` returns the result and the cancel is gone. In a busy token stream that race is common,
so a non-streaming request whose client had left could run to its end holding every block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def bounded(aw: Awaitable[T], timeout_s: float) -> T:
    """Await `aw` for at most `timeout_s` seconds (TimeoutError after, `aw` cancelled); a
    cancellation of the caller always propagates as CancelledError."""
    async with asyncio.timeout(timeout_s):
        return await aw
