"""In-process event hub: every subscriber gets every event after it subscribed.

A subscriber that falls more than ``maxsize`` events behind is disconnected
(its iterator ends with an 'events_dropped' marker) rather than slowing the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from orchestrrl.model import Phase


@dataclass(frozen=True)
class Event:
    kind: str
    timestamp: float = 0.0
    sequence: int = 0
    node: str = ""
    epoch: int = 0
    phase: Phase | None = None
    message: str = ""
    stages: dict[str, float] = field(default_factory=dict)


_OVERFLOW = Event(kind="events_dropped", message="subscriber fell behind; reconnect to resume")


class EventHub:
    def __init__(
        self, clock: Callable[[], float], maxsize: int = 1000, history: int = 1000
    ) -> None:
        self._clock = clock
        self._maxsize = maxsize
        self._sequence = 0
        self._subscribers: set[asyncio.Queue[Event]] = set()
        self._history: deque[Event] = deque(maxlen=history)

    def publish(self, event: Event) -> Event:
        self._sequence += 1
        stamped = replace(event, sequence=self._sequence, timestamp=self._clock())
        self._history.append(stamped)
        for q in list(self._subscribers):
            try:
                q.put_nowait(stamped)
            except asyncio.QueueFull:
                self._subscribers.discard(q)
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
                q.put_nowait(_OVERFLOW)
        return stamped

    def recent(self, n: int) -> list[Event]:
        return list(self._history)[-n:] if n > 0 else []

    async def subscribe(self, recent: int = 0) -> AsyncIterator[Event]:
        """The ``recent`` most recent events, then every new one."""
        q: asyncio.Queue[Event] = asyncio.Queue(self._maxsize)
        self._subscribers.add(q)
        try:
            for event in self.recent(recent):
                yield event
            while True:
                event = await q.get()
                yield event
                if event is _OVERFLOW:
                    return
        finally:
            self._subscribers.discard(q)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)
