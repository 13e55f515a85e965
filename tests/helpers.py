"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from orchestrrl.devcerts import CertFiles
from orchestrrl.tls import TlsConfig


class FakeClock:
    """A clock that moves only when a test sets ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def eventually(
    cond: Callable[[], bool], within_s: float = 5.0, poll_s: float = 0.002
) -> None:
    """Return once ``cond()`` holds; TimeoutError after ``within_s``."""
    async with asyncio.timeout(within_s):
        while not cond():  # noqa: ASYNC110 - polls state that other tasks change
            await asyncio.sleep(poll_s)


def tls(files: CertFiles) -> TlsConfig:
    """The mutual-TLS settings of a certificate from ``make_dev_pki``."""
    return TlsConfig(files.cert, files.key, files.ca)
