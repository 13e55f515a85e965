"""Idempotent commands: a repeated command_id returns the first result.

Each command runs as a task owned by the log, so a caller that disconnects mid-way does
not cancel a half-done reshard, and its retry (same command_id) waits for the same
outcome. Successful results are remembered (bounded, oldest first out); a failed command
is forgotten so that the caller may retry it with the same id.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from orchestrrl import errors

T = TypeVar("T")

DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class _Entry:
    kind: str
    request_key: bytes
    task: asyncio.Future[Any]


class CommandLog:
    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        *,
        observe: Callable[[str, str], None] | None = None,
    ) -> None:
        """``observe(kind, outcome)`` is told how each command ended: ``ok``, ``cancelled``,
        the error (``invalid_argument``, ``failed_precondition``, ...) or ``replayed``
        (a repeated command_id answered from the log)."""
        if capacity < 1:
            raise errors.field_error("capacity", capacity, "must be at least 1")
        self._capacity = capacity
        self._observe = observe
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def run(
        self,
        kind: str,
        command_id: str,
        request_key: bytes,
        action: Callable[[], Awaitable[T]],
    ) -> T:
        """Run ``action`` once per ``command_id``; ``request_key`` identifies the request
        so that reusing an id for a different command is refused instead of ignored."""
        if not command_id:
            raise errors.field_error(
                "command_id", command_id, "must be a non-empty id, unique per command"
            )
        entry = self._entries.get(command_id)
        if entry is not None and _failed(entry.task):  # its done-callback has not run yet
            del self._entries[command_id]
            entry = None
        if entry is None:
            entry = _Entry(kind, request_key, asyncio.ensure_future(action()))
            self._entries[command_id] = entry
            entry.task.add_done_callback(lambda task: self._settled(command_id, task))
            if self._observe is not None:
                entry.task.add_done_callback(lambda task: self._report(kind, task))
            self._evict()
        elif entry.kind != kind or entry.request_key != request_key:
            raise errors.InvalidArgument(
                f"command_id={command_id!r} was already used for a different {entry.kind} "
                "command; use a new command_id for a new command"
            )
        else:
            self._entries.move_to_end(command_id)
            if self._observe is not None:
                self._observe(kind, "replayed")
        result: T = await asyncio.shield(entry.task)
        return result

    async def close(self) -> None:
        """Cancel commands still running (at shutdown) and wait for them."""
        pending = [e.task for e in self._entries.values() if not e.task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._entries.clear()

    def _settled(self, command_id: str, task: asyncio.Future[Any]) -> None:
        entry = self._entries.get(command_id)
        if _failed(task) and entry is not None and entry.task is task:
            del self._entries[command_id]

    def _report(self, kind: str, task: asyncio.Future[Any]) -> None:
        assert self._observe is not None
        if task.cancelled():
            outcome = "cancelled"
        elif (exc := task.exception()) is None:
            outcome = "ok"
        else:
            outcome = _snake(type(exc).__name__)
        self._observe(kind, outcome)

    def _evict(self) -> None:
        """Forget the oldest finished commands beyond the capacity (never a running one)."""
        excess = len(self._entries) - self._capacity
        if excess <= 0:
            return
        for command_id in [k for k, e in self._entries.items() if e.task.done()][:excess]:
            del self._entries[command_id]


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def _failed(task: asyncio.Future[Any]) -> bool:
    """Done with an error or cancelled (reading the exception also marks it retrieved)."""
    return task.done() and (task.cancelled() or task.exception() is not None)
