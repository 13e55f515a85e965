"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from orchestrrl.devcerts import CertFiles
from orchestrrl.tls import TlsConfig


class FakeClock:
    """A clock that moves only when a test sets ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def eventually(
    cond: Callable[[], bool], within_s: float = 30.0, poll_s: float = 0.002
) -> None:
    """Return once ``cond()`` holds; TimeoutError after ``within_s`` (generous: a wait for
    liveness on a busy machine, never a check that something is fast)."""
    async with asyncio.timeout(within_s):
        while not cond():  # noqa: ASYNC110 - polls state that other tasks change
            await asyncio.sleep(poll_s)


async def until(
    check: Callable[[], Awaitable[bool]], within_s: float = 60.0, poll_s: float = 0.05
) -> None:
    """Return once ``await check()`` holds (a check that asks a server); TimeoutError
    after ``within_s``. Wait only for a state that stays once reached (a held one)."""
    async with asyncio.timeout(within_s):
        while not await check():  # noqa: ASYNC110 - polls a server, which has no event
            await asyncio.sleep(poll_s)


def tls(files: CertFiles) -> TlsConfig:
    """The mutual-TLS settings of a certificate from ``make_dev_pki``."""
    return TlsConfig(files.cert, files.key, files.ca)
