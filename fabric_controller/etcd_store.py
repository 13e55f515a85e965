"""Controller state in etcd: the replicated implementation of the store's contract.

The same async methods as the SQLite ``Store`` (``current``, ``by_request``, ``epoch``,
``commit``, ``outcome``, ``record_outcome``, ``pending``, ``begin``, ``advance``,
``abandon``), the same records, and the circuits encoded by the same JSON helpers.
Every state change is one etcd transaction, and every write is **fenced**: it compares
that the election key still exists with the leader's lease and create revision (its
fencing token), so a deposed leader's write changes nothing and raises ``NotLeader``.
A commit also compares the head epoch it follows, so two writers cannot both commit the
same epoch.

Keys under ``prefix`` (default ``/orchestrrl/``)::

    schema            the layout version ("1")
    head              the newest committed epoch number
    epochs/<n:012d>   an EpochRecord (JSON)
    requests/<id>     the epoch a request id committed
    outcomes/<id>     a RequestOutcome (JSON), the first one of an id
    pending           the journal: the reconfiguration in progress (JSON)
    pending-stage     its stage (advanced without rewriting the circuits)

Transient errors (a member down, a leader election in etcd) are retried on the next
endpoint until ``deadline_s``; then ``errors.Unavailable``. A write that etcd did not
confirm may still be applied (whole, never in part) once etcd regains a quorum: the
error says so, and the caller reads the state again before it acts on it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd
import aetcd.client
import aetcd.exceptions
import aetcd.rpc

from fabric_controller.leadership import NotLeader
from fabric_controller.store import (
    GENESIS,
    EpochRecord,
    PendingRecord,
    RequestOutcome,
    _circuits_json,
    _circuits_load,
    _missing_json,
    _missing_load,
)
from orchestrrl import errors
from orchestrrl.model import Phase

__all__ = ["DEFAULT_PREFIX", "Etcd", "EtcdStore", "Fence", "NotLeader", "parse_endpoint"]

LAYOUT_VERSION = "1"
DEFAULT_PREFIX = "/orchestrrl/"
T = TypeVar("T")

# Failures after which another endpoint (or the same one, a moment later) may answer: a
# member down or frozen, a leader election in progress, no quorum. etcd also reports its
# own timeouts with status UNKNOWN ("context deadline exceeded", "request timed out").
_TRANSIENT = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
)
_TRANSIENT_TEXT = ("deadline exceeded", "timed out", "leader", "too many requests")


def _transient(exc: Exception) -> bool:
    if isinstance(exc, _TRANSIENT):
        return True
    text = str(exc).lower()
    return any(t in text for t in _TRANSIENT_TEXT)


@dataclass(frozen=True)
class Fence:
    """What a leader's writes compare: the election ``key`` exists, is held by ``lease``,
    and was created at revision ``token`` (the fencing token, increasing with every
    new leader)."""

    key: bytes
    lease: int
    token: int


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) of an etcd member's client URL."""
    host, sep, port = text.strip().removeprefix("http://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.field_error("etcd endpoint", text, "host:port, e.g. 127.0.0.1:2379")
    return host.strip("[]"), int(port)


class Etcd:
    """A connection to an etcd cluster: one aetcd client per endpoint, used in turn.

    ``run`` calls an operation on the current endpoint's client; a transient failure moves
    to the next endpoint and retries until ``deadline_s``. Each call waits at most
    ``call_timeout_s`` (a frozen member answers nothing, so it must not hold a call).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        call_timeout_s: float = 1.0,
        deadline_s: float = 5.0,
    ) -> None:
        if not endpoints:
            raise errors.field_error("etcd endpoints", list(endpoints), "at least one host:port")
        if not 0 < call_timeout_s <= deadline_s:
            raise errors.field_error(
                "etcd call_timeout_s", call_timeout_s, f"> 0 and <= deadline_s ({deadline_s})"
            )
        self.endpoints = [f"{h}:{p}" for h, p in map(parse_endpoint, endpoints)]
        self.deadline_s = deadline_s
        self._clients = [
            aetcd.Client(host=h, port=p, timeout=call_timeout_s)
            for h, p in map(parse_endpoint, endpoints)
        ]
        self._at = 0

    async def run(
        self,
        what: str,
        op: Callable[[Any], Awaitable[T]],
        deadline_s: float | None = None,
    ) -> T:
        """``await op(client)``, retried on the next endpoint after a transient failure;
        ``errors.Unavailable`` naming ``what`` when none answered within the deadline."""
        deadline = time.monotonic() + (self.deadline_s if deadline_s is None else deadline_s)
        delay = 0.02
        tried: list[str] = []
        while True:
            at = self._at
            try:
                return await op(self._clients[at])
            except aetcd.exceptions.ClientError as exc:
                if not _transient(exc):
                    raise errors.FailedPrecondition(f"etcd {what}: {exc}") from None
                tried.append(f"{self.endpoints[at]}: {exc}")
                self._at = (at + 1) % len(self._clients)
            if time.monotonic() + delay >= deadline:
                raise errors.Unavailable(
                    f"etcd {what}: no quorum answered within {self.deadline_s:g} s "
                    f"({errors.listed(reversed(tried), limit=3)}); a write is applied whole "
                    "or not at all, and may still be applied when etcd has a quorum again: "
                    "read the state again before retrying"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def close(self) -> None:
        for c in self._clients:
            await c.close()


class _Lease:
    """A txn compare on the lease of a key (aetcd builds VERSION/CREATE/MOD/VALUE only)."""

    def __init__(self, key: bytes, lease: int) -> None:
        self.key, self.lease = key, lease

    def build_message(self) -> Any:
        c = aetcd.rpc.Compare()
        c.key = self.key
        c.result = aetcd.rpc.Compare.EQUAL
        c.target = aetcd.rpc.Compare.LEASE
        c.lease = self.lease
        return c


# aetcd's builders of transaction compares and operations (client.transactions)
_T: Any = aetcd.client.Transactions()


def fence_compares(fence: Fence) -> list[Any]:
    """The election key is held by the fence's lease and was created at its token."""
    return [_Lease(fence.key, fence.lease), _T.create(fence.key) == fence.token]


# -- records as JSON (the circuits by the SQLite store's helpers) --


def epoch_json(r: EpochRecord) -> bytes:
    assert r.phase is not None
    return json.dumps(
        {
            "epoch": r.epoch,
            "phase": r.phase.value,
            "circuits": _circuits_json(r.circuits),
            "added": _circuits_json(r.added),
            "removed": _circuits_json(r.removed),
            "stages": r.stages,
            "committed_at": r.committed_at,
            "request_id": r.request_id,
            "missing": _missing_json(r.missing),
        },
        separators=(",", ":"),
    ).encode()


def epoch_load(raw: bytes) -> EpochRecord:
    d = json.loads(raw)
    return EpochRecord(
        epoch=int(d["epoch"]),
        phase=Phase(d["phase"]),
        circuits=_circuits_load(d["circuits"]),
        added=_circuits_load(d["added"]),
        removed=_circuits_load(d["removed"]),
        stages={str(k): float(v) for k, v in d["stages"].items()},
        committed_at=float(d["committed_at"]),
        request_id=d["request_id"],
        missing=_missing_load(d["missing"]),
    )


def pending_json(p: PendingRecord) -> bytes:
    return json.dumps(
        {
            "epoch": p.epoch,
            "phase": p.phase.value,
            "circuits": _circuits_json(p.circuits),
            "added": _circuits_json(p.added),
            "removed": _circuits_json(p.removed),
            "request_id": p.request_id,
            "started_at": p.started_at,
            "missing": _missing_json(p.missing),
        },
        separators=(",", ":"),
    ).encode()


def pending_load(raw: bytes, stage: str) -> PendingRecord:
    d = json.loads(raw)
    return PendingRecord(
        epoch=int(d["epoch"]),
        phase=Phase(d["phase"]),
        circuits=_circuits_load(d["circuits"]),
        added=_circuits_load(d["added"]),
        removed=_circuits_load(d["removed"]),
        stage=stage,
        request_id=d["request_id"],
        started_at=float(d["started_at"]),
        missing=_missing_load(d["missing"]),
    )


def outcome_json(o: RequestOutcome) -> bytes:
    return json.dumps(
        {
            "request_id": o.request_id,
            "phase": o.phase.value,
            "epoch": o.epoch,
            "changed": o.changed,
            "gated": o.gated,
            "message": o.message,
            "explanation": o.explanation,
            "recorded_at": o.recorded_at,
        },
        separators=(",", ":"),
    ).encode()


def outcome_load(raw: bytes) -> RequestOutcome:
    d = json.loads(raw)
    return RequestOutcome(
        request_id=d["request_id"],
        phase=Phase(d["phase"]),
        epoch=int(d["epoch"]),
        changed=bool(d["changed"]),
        gated=bool(d["gated"]),
        message=d["message"],
        explanation=d["explanation"],
        recorded_at=float(d["recorded_at"]),
    )


def _first(responses: list[Any], i: int) -> bytes | None:
    """The value of the i-th Get of a transaction's responses (None: no such key)."""
    kvs = responses[i]
    return bytes(kvs[0][0]) if kvs else None


class EtcdStore:
    """The controller's state in etcd under ``prefix``; writes need a ``fence``
    (``fenced``), reads do not. Open with ``await EtcdStore.open(etcd, ...)``."""

    def __init__(self, etcd: Etcd, prefix: str = DEFAULT_PREFIX, fence: Fence | None = None):
        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise errors.field_error("etcd prefix", prefix, "a path that starts and ends with /")
        self.etcd = etcd
        self.prefix = prefix
        self.fence = fence
        self._p = prefix.encode()

    @classmethod
    async def open(
        cls, etcd: Etcd, prefix: str = DEFAULT_PREFIX, fence: Fence | None = None
    ) -> EtcdStore:
        """The store, after checking (or, on an empty prefix, writing) its layout version."""
        store = cls(etcd, prefix, fence)
        await store._check_layout()
        return store

    @property
    def path(self) -> str:
        """Where the state is, for logs (the SQLite store's file path)."""
        return f"etcd://{','.join(self.etcd.endpoints)}{self.prefix}"

    @property
    def location(self) -> str:
        """``EpochStore.location``: the endpoints and the key prefix."""
        return self.path

    def fenced(self, fence: Fence) -> EtcdStore:
        """The same store writing as the leader that holds ``fence``."""
        return EtcdStore(self.etcd, self.prefix, fence)

    async def close(self) -> None:
        await self.etcd.close()

    # -- keys --

    def _k(self, name: str) -> bytes:
        return self._p + name.encode()

    def _epoch_key(self, n: int) -> bytes:
        return self._k(f"epochs/{n:012d}")

    # -- helpers --

    def _need_fence(self, what: str) -> Fence:
        if self.fence is None:
            raise errors.FailedPrecondition(
                f"etcd store {what}: refused, this store is not fenced (only the leader "
                "writes: use store.fenced(election.fence) after winning the election)"
            )
        return self.fence

    def _deposed(self, what: str, fence: Fence, holder: bytes | None) -> NotLeader:
        now = "nobody holds it" if holder is None else f"held by {holder.decode(errors='replace')}"
        return NotLeader(
            f"etcd store {what}: refused, this controller is no longer the leader "
            f"(fencing token {fence.token}, lease {fence.lease:x}; the election key "
            f"{fence.key.decode(errors='replace')!r}: {now}); it changes nothing"
        )

    async def _get(self, what: str, key: bytes) -> bytes | None:
        async def op(c: Any) -> bytes | None:
            got = await c.get(key)
            return None if got is None else bytes(got.value)

        return await self.etcd.run(what, op)

    async def _txn(
        self, what: str, compare: list[Any], success: list[Any], failure: list[Any]
    ) -> tuple[bool, list[Any]]:
        async def op(c: Any) -> tuple[bool, list[Any]]:
            ok, responses = await c.transaction(compare=compare, success=success, failure=failure)
            return bool(ok), list(responses)

        return await self.etcd.run(what, op)

    @property
    def _t(self) -> Any:
        return _T

    async def _check_layout(self) -> None:
        key = self._k("schema")
        t = self._t
        _, responses = await self._txn(
            "open",
            [t.version(key) == 0],
            [t.put(key, LAYOUT_VERSION.encode())],
            [t.get(key)],
        )
        found = _first(responses, 0) if responses and isinstance(responses[0], list) else None
        if found is not None and found.decode() != LAYOUT_VERSION:
            raise errors.FailedPrecondition(
                f"etcd prefix {self.prefix!r} has layout version {found.decode()!r}, this "
                f"controller reads version {LAYOUT_VERSION}"
            )

    async def _fenced_write(self, what: str, compare: list[Any], success: list[Any]) -> None:
        fence = self._need_fence(what)
        t = self._t
        ok, responses = await self._txn(
            what, [*fence_compares(fence), *compare], success,
            [t.get(fence.key)],
        )  # fmt: skip
        if not ok:
            raise self._deposed(what, fence, _first(responses, 0))

    # -- reads --

    async def current(self) -> EpochRecord:
        head = await self._get("read the head epoch", self._k("head"))
        if head is None:
            return GENESIS
        return await self.epoch(int(head))

    async def epoch(self, epoch: int) -> EpochRecord:
        """A committed epoch by number (0: the genesis); NotFound if it is not stored."""
        if epoch == 0:
            return GENESIS
        raw = await self._get(f"read epoch {epoch}", self._epoch_key(epoch))
        if raw is None:
            raise errors.NotFound(f"epoch {epoch} is not in etcd at {self.path}")
        return epoch_load(raw)

    async def by_request(self, request_id: str) -> EpochRecord | None:
        n = await self._get("read a request id", self._k(f"requests/{request_id}"))
        return None if n is None else await self.epoch(int(n))

    async def outcome(self, request_id: str) -> RequestOutcome | None:
        raw = await self._get("read an outcome", self._k(f"outcomes/{request_id}"))
        return None if raw is None else outcome_load(raw)

    async def pending(self) -> PendingRecord | None:
        t = self._t
        _, responses = await self._txn(
            "read the journal", [], [t.get(self._k("pending")), t.get(self._k("pending-stage"))], []
        )
        raw, stage = _first(responses, 0), _first(responses, 1)
        if raw is None:
            return None
        return pending_load(raw, "" if stage is None else stage.decode())

    # -- writes (each one fenced transaction) --

    async def begin(self, p: PendingRecord) -> None:
        t = self._t
        await self._fenced_write(
            "begin a reconfiguration",
            [],
            [t.put(self._k("pending"), pending_json(p)),
             t.put(self._k("pending-stage"), p.stage.encode())],
        )  # fmt: skip

    async def advance(self, stage: str) -> None:
        """Set the journal's stage; nothing when there is no journal (as SQLite's UPDATE)."""
        fence = self._need_fence("advance the journal")
        t = self._t
        pending = self._k("pending")
        ok, responses = await self._txn(
            "advance the journal",
            fence_compares(fence),
            [t.txn([t.version(pending) > 0], [t.put(self._k("pending-stage"), stage.encode())],
                   [])],
            [t.get(fence.key)],
        )  # fmt: skip
        if not ok:
            raise self._deposed("advance the journal", fence, _first(responses, 0))

    async def abandon(self) -> None:
        t = self._t
        await self._fenced_write(
            "abandon the reconfiguration",
            [],
            [t.delete(self._k("pending")), t.delete(self._k("pending-stage"))],
        )

    async def schedule_memory(self) -> bytes | None:
        return await self._get("read the schedule memory", self._k("schedule-memory"))

    async def save_schedule_memory(self, blob: bytes) -> None:
        t = self._t
        await self._fenced_write(
            "save the schedule memory", [], [t.put(self._k("schedule-memory"), blob)]
        )

    async def record_outcome(self, outcome: RequestOutcome) -> RequestOutcome:
        """Record ``outcome`` unless its id has one already; returns the one recorded."""
        what = "record an outcome"
        fence = self._need_fence(what)
        t = self._t
        key = self._k(f"outcomes/{outcome.request_id}")
        ok, responses = await self._txn(
            what,
            [*fence_compares(fence), t.version(key) == 0],
            [t.put(key, outcome_json(outcome))],
            [t.get(key), t.get(fence.key)],
        )
        if ok:
            return outcome
        recorded = _first(responses, 0)
        if recorded is not None:
            return outcome_load(recorded)
        raise self._deposed(what, fence, _first(responses, 1))

    async def commit(
        self, record: EpochRecord, outcome: RequestOutcome | None = None
    ) -> EpochRecord:
        """Store epoch ``record`` as the successor of the head epoch, index its request id,
        record the ``outcome`` of its request (first one wins) and clear the journal, in
        one fenced transaction. ``errors.Aborted`` when the head is not its predecessor
        (another writer committed), ``NotLeader`` when this controller was deposed."""
        n = record.epoch
        what = f"commit epoch {n}"
        fence = self._need_fence(what)
        if record.phase is None or n < 1:
            raise errors.field_error("epoch", n, "a committed epoch has a number >= 1 and a phase")
        t = self._t
        head, key = self._k("head"), self._epoch_key(n)
        value = epoch_json(record)
        compare = [
            *fence_compares(fence),
            (t.version(head) == 0) if n == 1 else (t.value(head) == str(n - 1).encode()),
            t.version(key) == 0,
        ]
        success = [
            t.put(key, value),
            t.put(head, str(n).encode()),
            t.delete(self._k("pending")),
            t.delete(self._k("pending-stage")),
        ]
        if record.request_id is not None:
            request = self._k(f"requests/{record.request_id}")
            compare.append(t.version(request) == 0)
            success.append(t.put(request, str(n).encode()))
        if outcome is not None:
            okey = self._k(f"outcomes/{outcome.request_id}")
            success.append(t.txn([t.version(okey) == 0], [t.put(okey, outcome_json(outcome))], []))
        failure = [t.get(fence.key), t.get(head), t.get(key)]
        if record.request_id is not None:
            failure.append(t.get(self._k(f"requests/{record.request_id}")))
        ok, responses = await self._txn(what, compare, success, failure)
        if ok:
            return record
        holder, last, stored = (_first(responses, i) for i in range(3))
        if stored == value:  # an earlier attempt of this very commit was applied
            return record
        if holder is None or not self._holds(responses[0], fence):
            raise self._deposed(what, fence, holder)
        last_n = 0 if last is None else int(last)
        if last_n != n - 1 or stored is not None:
            raise errors.Aborted(f"epoch {n} cannot follow epoch {last_n} (another writer?)")
        taken = _first(responses, 3)
        raise errors.FailedPrecondition(
            f"request id {record.request_id!r} already committed epoch "
            f"{taken.decode() if taken else '?'}"
        )

    @staticmethod
    def _holds(kvs: list[Any], fence: Fence) -> bool:
        if not kvs:
            return False
        kv = kvs[0][1]
        return bool(kv.lease == fence.lease and kv.create_revision == fence.token)
