"""The idempotent command log: a repeated command_id returns the first result."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.commands import CommandLog
from orchestrrl import errors

pytestmark = pytest.mark.unit


class Counter:
    def __init__(self) -> None:
        self.runs = 0

    async def __call__(self) -> int:
        self.runs += 1
        return self.runs


async def test_a_repeated_id_returns_the_first_result() -> None:
    log = CommandLog()
    action = Counter()
    assert await log.run("Drain", "c1", b"req", action) == 1
    assert await log.run("Drain", "c1", b"req", action) == 1
    assert await log.run("Drain", "c2", b"req2", action) == 2
    assert action.runs == 2


async def test_concurrent_duplicates_run_once() -> None:
    log = CommandLog()
    gate = asyncio.Event()
    runs = 0

    async def slow() -> str:
        nonlocal runs
        runs += 1
        await gate.wait()
        return "done"

    first = asyncio.create_task(log.run("Reshard", "c1", b"r", slow))
    second = asyncio.create_task(log.run("Reshard", "c1", b"r", slow))
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(first, second) == ["done", "done"]
    assert runs == 1


async def test_a_caller_that_goes_away_does_not_cancel_the_command() -> None:
    log = CommandLog()
    gate = asyncio.Event()

    async def slow() -> str:
        await gate.wait()
        return "finished"

    caller = asyncio.create_task(log.run("Reshard", "c1", b"r", slow))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    gate.set()
    assert await log.run("Reshard", "c1", b"r", slow) == "finished"


async def test_reusing_an_id_for_another_command_is_refused() -> None:
    log = CommandLog()
    await log.run("Drain", "c1", b"drain", Counter())
    with pytest.raises(errors.InvalidArgument, match=r"command_id='c1'.*Drain"):
        await log.run("Resume", "c1", b"resume", Counter())
    with pytest.raises(errors.InvalidArgument, match="new command_id"):
        await log.run("Drain", "c1", b"other", Counter())


async def test_empty_id_is_refused() -> None:
    with pytest.raises(errors.InvalidArgument, match="command_id=''"):
        await CommandLog().run("Drain", "", b"", Counter())


async def test_a_failed_command_may_be_retried_with_its_id() -> None:
    log = CommandLog()
    attempts = 0

    async def flaky() -> str:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise errors.Aborted("busy")
        return "ok"

    with pytest.raises(errors.Aborted):
        await log.run("Reshard", "c1", b"r", flaky)
    assert await log.run("Reshard", "c1", b"r", flaky) == "ok"
    assert attempts == 2


async def test_the_log_is_bounded() -> None:
    log = CommandLog(capacity=3)
    action = Counter()
    for i in range(10):
        await log.run("Drain", f"c{i}", b"", action)
    assert len(log) == 3
    assert await log.run("Drain", "c9", b"", action) == 10  # recent: remembered
    assert await log.run("Drain", "c0", b"", action) == 11  # evicted: runs again


async def test_close_cancels_running_commands() -> None:
    log = CommandLog()
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    caller = asyncio.create_task(log.run("Reshard", "c1", b"", forever))
    await started.wait()
    await log.close()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert len(log) == 0


def test_capacity_must_be_positive() -> None:
    with pytest.raises(errors.InvalidArgument, match="capacity=0"):
        CommandLog(capacity=0)
