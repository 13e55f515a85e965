"""A simulated optical circuit switch (OCS): an in-memory cross-connect table.

Pure and synchronous: no clock, no I/O. ``sim_backends.ocs_server`` serves it over gRPC
and adds the switching delay. Like faucet's fake switch it answers questions about
behaviour (``is_connected``, ``peer``), so tests assert what the fabric does rather than
which calls were made. Fault injection: ports can be set DOWN, the next apply can be made
to fail, or to be acknowledged without changing anything (a switch that lies).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from orchestrrl import errors
from orchestrrl.fencing import FencingGate

Pair = tuple[int, int]

MAX_PORTS = 4096  # far above any commercial OCS; keeps ListPorts answers small
REPLAY_CACHE_SIZE = 1024  # request ids remembered for idempotent retries (LRU)


@dataclass(frozen=True)
class PortStatus:
    port: int
    up: bool
    peer: int | None


@dataclass(frozen=True)
class ApplyResult:
    """The outcome of a batch: the table after it and its net change.

    ``replayed`` is true when the answer came from the idempotency cache (a repeated
    ``request_id``): nothing was changed, and the table is the one of the first answer.
    """

    cross_connects: frozenset[Pair]
    added: frozenset[Pair]
    removed: frozenset[Pair]
    replayed: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed) and not self.replayed


_Batch = tuple[tuple[Pair, ...], tuple[Pair, ...]]


class SimulatedOcs:
    """Ports 1..port_count; bidirectional cross-connects reported as ``(a, b)`` with a < b."""

    def __init__(self, name: str, port_count: int, switching_time_s: float = 0.0) -> None:
        if not name:
            raise errors.field_error("name", name, "must be a non-empty name, e.g. ocs0")
        if not 1 <= port_count <= MAX_PORTS:
            raise errors.field_error("port_count", port_count, f"must be 1..{MAX_PORTS}")
        if not (math.isfinite(switching_time_s) and switching_time_s >= 0):
            raise errors.field_error("switching_time_s", switching_time_s, "must be >= 0")
        self.name = name
        # the newest controller fencing token seen (controller HA; 0: none yet)
        self.fencing = FencingGate(f"OCS {name}")
        self.port_count = port_count
        self.switching_time_s = switching_time_s
        self._peers: dict[int, int] = {}  # symmetric: _peers[a] == b iff _peers[b] == a
        self._down: set[int] = set()
        self._fault: str | None = None
        self._ignore_next = False
        self._table: frozenset[Pair] | None = None  # cross_connects(), until the next change
        self._answers: OrderedDict[str, tuple[_Batch, ApplyResult]] = OrderedDict()

    # Questions

    def cross_connects(self) -> frozenset[Pair]:
        if self._table is None:
            self._table = frozenset((a, b) for a, b in self._peers.items() if a < b)
        return self._table

    def down_ports(self) -> frozenset[int]:
        """Ports whose health is DOWN."""
        return frozenset(self._down)

    def peer(self, port: int) -> int | None:
        self._check_port("port", port)
        return self._peers.get(port)

    def is_connected(self, a: int, b: int) -> bool:
        self._check_port("a", a)
        self._check_port("b", b)
        return self._peers.get(a) == b

    def port_states(self) -> tuple[PortStatus, ...]:
        return tuple(
            PortStatus(p, p not in self._down, self._peers.get(p))
            for p in range(1, self.port_count + 1)
        )

    # Fault injection

    def set_port_health(self, port: int, up: bool) -> None:
        """A DOWN port refuses new circuits; a circuit already on it stays in the table."""
        self._check_port("port", port)
        if up:
            self._down.discard(port)
        else:
            self._down.add(port)

    def fail_next_apply(self, message: str = "simulated switching failure") -> None:
        """Make the next apply that reaches the optics (not a replay) fail, changing nothing."""
        self._fault = message

    def ignore_next_apply(self) -> None:
        """Make the next valid apply (not a replay) answer as if applied but change nothing:
        the answer carries the true, unchanged table (a switch whose optics did not move)."""
        self._ignore_next = True

    # Changes

    def apply(
        self,
        disconnect: Iterable[Pair],
        connect: Iterable[Pair],
        *,
        request_id: str = "",
        fencing_token: int = 0,
    ) -> ApplyResult:
        """Apply a batch atomically: all disconnects, then all connects, or nothing.

        The connects are validated against the table after the disconnects, so a batch may
        move a port from one peer to another. Raises ``InvalidArgument`` naming every bad
        item, or ``FailedPrecondition`` for an injected fault; the table is then unchanged.
        A repeated ``request_id`` returns the first answer with ``replayed=True``. A
        ``fencing_token`` older than the newest seen is refused (``FailedPrecondition``)
        before anything else; 0 means no HA. Only a batch carried out that lists a change
        makes its token the newest (``FencingGate``): an empty or refused one does not.
        """
        self.fencing.check(fencing_token)
        batch: _Batch = (tuple(disconnect), tuple(connect))
        self.check_batch_size(len(batch[0]), len(batch[1]))
        if request_id and (seen := self._answers.get(request_id)) is not None:
            first_batch, first = seen
            if first_batch != batch:
                raise errors.field_error(
                    "request_id", request_id, "was already used for a different batch; use a new id"
                )
            self._answers.move_to_end(request_id)
            if batch[0] or batch[1]:
                self.fencing.record(fencing_token)
            return replace(first, replayed=True)
        if self._fault is not None:
            message, self._fault = self._fault, None
            raise errors.FailedPrecondition(f"OCS {self.name}: injected fault: {message}")
        before = self.cross_connects()
        peers = self._planned(*batch)
        if self._ignore_next:
            self._ignore_next = False
        else:
            self._peers = peers
            self._table = None
        after = self.cross_connects()
        result = ApplyResult(after, added=after - before, removed=before - after)
        if request_id:
            self._answers[request_id] = (batch, result)
            if len(self._answers) > REPLAY_CACHE_SIZE:
                self._answers.popitem(last=False)
        if batch[0] or batch[1]:
            self.fencing.record(fencing_token)
        return result

    def check_batch_size(self, disconnect: int, connect: int) -> None:
        """A batch lists each port at most once among its disconnects and once among its
        connects, so neither list can hold more than ``port_count // 2`` valid pairs; a
        longer one is refused at once, before any item is looked at."""
        most = self.port_count // 2
        for field, count in (("disconnect", disconnect), ("connect", connect)):
            if count > most:
                raise errors.field_error(
                    field,
                    f"{count} pairs",
                    f"at most {most} pairs: this switch has {self.port_count} ports "
                    "and a batch lists each port once",
                )

    def _planned(self, disconnect: tuple[Pair, ...], connect: tuple[Pair, ...]) -> dict[int, int]:
        """The peer map after the batch, built on a copy; raises if any item is invalid."""
        fast = self._planned_valid(disconnect, connect)
        if fast is not None:
            return fast
        peers = dict(self._peers)
        problems = errors.Problems()  # the first few named, the rest counted
        listed: dict[Pair, str] = {}
        for i, (a, b) in enumerate(disconnect):
            field = f"disconnect[{i}]"
            if bad := self._pair_problems(field, a, b):
                problems.extend(bad)
                continue
            pair = (min(a, b), max(a, b))
            if pair in listed:
                problems.add(_problem(field, pair, f"already listed as {listed[pair]}"))
            elif self._peers.get(a) != b:
                where = f"{self._where(a)}, {self._where(b)}"
                why = f"ports {a} and {b} are not cross-connected ({where})"
                problems.add(_problem(field, pair, why))
            else:
                listed[pair] = field
                del peers[a], peers[b]
        claimed: dict[int, str] = {}
        for i, (a, b) in enumerate(connect):
            field = f"connect[{i}]"
            if bad := self._pair_problems(field, a, b):
                problems.extend(bad)
                continue
            bad = [
                _problem(f"{field}.{end}", port, why)
                for end, port in (("a", a), ("b", b))
                if (why := self._busy(port, peers, claimed))
            ]
            problems.extend(bad)
            if not bad:
                claimed[a] = claimed[b] = field
                peers[a], peers[b] = b, a
        if problems:
            raise problems.error()
        return peers

    def _planned_valid(
        self, disconnect: tuple[Pair, ...], connect: tuple[Pair, ...]
    ) -> dict[int, int] | None:
        """The peer map after a batch with no invalid item, in one cheap pass; None at
        the first doubt (then ``_planned`` checks every item and names each problem)."""
        peers = dict(self._peers)
        for a, b in disconnect:
            if a == b or peers.get(a) != b:  # also catches a pair listed twice
                return None
            del peers[a], peers[b]
        n, down = self.port_count, self._down
        for a, b in connect:
            if (
                a == b
                or not (1 <= a <= n and 1 <= b <= n)
                or a in peers
                or b in peers
                or a in down
                or b in down
            ):
                return None
            peers[a] = b
            peers[b] = a
        return peers

    def _busy(self, port: int, peers: dict[int, int], claimed: dict[int, str]) -> str:
        """Why ``port`` cannot take a new circuit in this batch ('' when it can)."""
        if port in self._down:
            return f"port {port} is DOWN; bring it up or pick another port"
        if port in claimed:
            return f"port {port} is already used by {claimed[port]} of this batch"
        if port in peers:
            other = peers[port]
            return (
                f"port {port} is already connected to port {other}; "
                f"disconnect {(min(port, other), max(port, other))} first"
            )
        return ""

    def _pair_problems(self, field: str, a: int, b: int) -> list[str]:
        problems = [
            _problem(f"{field}.{end}", port, f"port must be 1..{self.port_count}")
            for end, port in (("a", a), ("b", b))
            if not 1 <= port <= self.port_count
        ]
        if not problems and a == b:
            problems.append(
                _problem(f"{field}.b", b, "must differ from a: a port cannot connect to itself")
            )
        return problems

    def _where(self, port: int) -> str:
        peer = self._peers.get(port)
        return f"port {port} is free" if peer is None else f"port {port} is connected to {peer}"

    def _check_port(self, field: str, port: int) -> None:
        if not 1 <= port <= self.port_count:
            raise errors.field_error(field, port, f"port must be 1..{self.port_count}")


def _problem(field: str, value: object, allowed: str) -> str:
    return str(errors.field_error(field, value, allowed))
