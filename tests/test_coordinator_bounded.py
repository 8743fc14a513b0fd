"""`coordinator.bounded`: a bounded wait times out, and a cancellation that lands in the same loop
turn as the awaited result still cancels (Python 3.11's `asyncio.wait_for` returns the result
there instead: the race that let a non-streaming request outlive its departed client)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.bounded import bounded


def test_times_out_and_cancels_what_it_awaited():
    async def main():
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await bounded(never, 0.05)
        return never.cancelled()

    assert asyncio.run(main())


def test_returns_the_result_in_time():
    async def main():
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(fut.set_result, 7)
        return await bounded(fut, 5.0)

    assert asyncio.run(main()) == 7


def test_a_cancel_in_the_same_turn_as_the_result_is_not_lost():
    async def main():
        fut = asyncio.get_running_loop().create_future()
        waiter = asyncio.create_task(bounded(fut, 5.0))
        await asyncio.sleep(0)  # the waiter now waits on fut
        fut.set_result("a token")  # the result and the cancel arrive in one loop turn
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(main())


def test_a_cancel_in_the_same_turn_as_a_queue_item_leaves_the_item_queued():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        waiter = asyncio.create_task(bounded(q.get(), 5.0))
        await asyncio.sleep(0)
        q.put_nowait("event")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return q.qsize()

    assert asyncio.run(main()) == 1
