"""Small helpers shared by the tests."""

from __future__ import annotations


class FakeClock:
    """A clock that moves only when a test sets ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
