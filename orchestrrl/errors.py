"""Domain errors. Each maps to one gRPC status code in one place (grpcutil).

Every message is bounded, whatever the input: a value quoted in a message is cut to
``MAX_VALUE_CHARS`` (``shown``), a list of offenders names the first ``MAX_LISTED`` and
counts the rest (``listed``, ``Problems``), and a message sent to a caller is cut to
``MAX_MESSAGE_BYTES`` (``bounded``): a hostile or broken request of a million bad items
costs a count, not a message of a hundred megabytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

MAX_VALUE_CHARS = 256  # of a value quoted in a message (its repr)
MAX_LISTED = 5  # offenders named in a message; the rest are counted ("and N more")
# Of a message sent to a caller (a gRPC status message travels in a trailer, and gRPC's
# default metadata limit is 8 KiB; percent-encoding may triple non-ASCII bytes).
MAX_MESSAGE_BYTES = 2048


class OrlError(Exception):
    """Base of every error OrchestrRL reports to a person or a caller."""


class InvalidArgument(OrlError):
    """The request or file is wrong: names the field, the value and what is allowed."""


class FailedPrecondition(OrlError):
    """The request is well-formed but the system is not in a state to do it."""


class NotFound(OrlError):
    """A named thing (node, OCS, pod) does not exist."""


class Aborted(OrlError):
    """A conflicting operation is in progress; try again."""


class Unavailable(OrlError):
    """A dependency (switch, agent, controller) could not be reached."""


class DeadlineExceeded(OrlError):
    """The operation did not finish in the time it was given; nothing was changed."""


def field_error(field: str, value: object, allowed: str) -> InvalidArgument:
    """The one shape of a bad-input message: field, value (``shown``), what is allowed."""
    return InvalidArgument(f"{field}={shown(value)} is not valid: {allowed}")


def shown(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """``repr(value)`` for a message, at most about ``limit`` characters: a longer string
    is cut with "..." and its length, a long collection shows its first ``MAX_LISTED``
    items and its size. Cheap on huge values (never builds their whole repr)."""
    if isinstance(value, str | bytes | bytearray):
        text = repr(value[:limit])
        if len(value) <= limit and len(text) <= limit + 2:  # + the quotes
            return text
        unit = "characters" if isinstance(value, str) else "bytes"
        head = text if len(text) <= limit + 2 else text[:limit]
        return f"{head}... ({len(value)} {unit})"
    if isinstance(value, list | tuple | set | frozenset | dict) and len(value) > MAX_LISTED:
        items = ", ".join(shown(x, limit // MAX_LISTED) for x in islice(value, MAX_LISTED))
        return f"[{items}, ...] ({len(value)} items)"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def listed(items: Iterable[str], sep: str = "; ", limit: int = MAX_LISTED) -> str:
    """The first ``limit`` items joined by ``sep``, then "and N more" for the rest."""
    it = iter(items)
    head = list(islice(it, limit))
    rest = sum(1 for _ in it)
    return sep.join(head) + (f"{sep}and {rest} more" if rest else "")


class Problems:
    """The problems found in one input: the first ``limit`` kept as text, the rest only
    counted, so that a huge bad input costs a count rather than a huge message."""

    def __init__(self, limit: int = MAX_LISTED) -> None:
        self.limit = limit
        self.shown: list[str] = []
        self.count = 0

    @property
    def full(self) -> bool:
        """No more text is kept: a caller may count further problems without formatting."""
        return len(self.shown) >= self.limit

    def add(self, problem: str) -> None:
        self.count += 1
        if not self.full:
            self.shown.append(problem)

    def extend(self, problems: Iterable[str]) -> None:
        for p in problems:
            self.add(p)

    def __bool__(self) -> bool:
        return self.count > 0

    def __len__(self) -> int:
        return self.count

    def text(self, sep: str = "; ") -> str:
        rest = self.count - len(self.shown)
        return sep.join(self.shown) + (f"{sep}and {rest} more" if rest else "")

    def error(self, prefix: str = "") -> InvalidArgument:
        return InvalidArgument(prefix + self.text())


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``message`` cut to at most ``limit`` UTF-8 bytes, keeping its head and its tail
    (where the advice usually is) around a note of how much was cut."""
    data = message.encode("utf-8", "replace")
    if len(data) <= limit:
        return message
    tail_bytes = limit // 4
    head_bytes = limit - tail_bytes - 40
    head = data[:head_bytes].decode("utf-8", "ignore")
    tail = data[-tail_bytes:].decode("utf-8", "ignore")
    cut = len(data) - len(head.encode()) - len(tail.encode())
    return f"{head} ... [{cut} bytes cut] ... {tail}"


class Unauthenticated(OrlError):
    """The caller presented no acceptable identity."""


class PermissionDenied(OrlError):
    """The caller is known but not allowed to do this."""
