"""The sampling clock: ticks at a fixed rate on the running loop, and nothing left behind."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.telemetry import set_done, ticks

pytestmark = pytest.mark.unit


async def test_ticks_at_once_then_each_interval_read_at_every_tick() -> None:
    loop = asyncio.get_running_loop()
    asked: list[float] = []

    def interval() -> float:  # a callable interval: a reload applies from the next tick
        asked.append(loop.time())
        return 0.01 * len(asked)

    start = loop.time()
    seen = []
    async for _ in ticks(interval):
        seen.append(loop.time())
        if len(seen) == 3:
            break
    assert len(asked) == 2  # read once per tick after the first
    # fixed rate: each tick no earlier than its deadline (start + 0.01, then + 0.02 more)
    assert seen[1] >= start + 0.01 - 1e-3
    assert seen[2] >= start + 0.03 - 1e-3


async def test_cancelled_while_waiting_leaves_no_timer() -> None:
    loop = asyncio.get_running_loop()
    timers: list[asyncio.TimerHandle] = []
    call_at = loop.call_at

    def recording_call_at(when, callback, *args):  # type: ignore[no-untyped-def]
        timers.append(call_at(when, callback, *args))
        return timers[-1]

    loop.call_at = recording_call_at  # type: ignore[method-assign,assignment]
    try:

        async def consume() -> None:
            async for _ in ticks(3600.0):
                pass

        task = asyncio.create_task(consume())
        while not timers:  # noqa: ASYNC110 - waits for the task to reach its first wait
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        del loop.call_at
    assert len(timers) == 1 and timers[0].cancelled()


async def test_set_done_completes_a_pending_future_and_leaves_a_done_one() -> None:
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[None] = loop.create_future()
    set_done(pending)
    assert pending.done() and pending.result() is None
    cancelled: asyncio.Future[None] = loop.create_future()
    cancelled.cancel()
    set_done(cancelled)  # no InvalidStateError
    assert cancelled.cancelled()
