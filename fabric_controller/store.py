"""Persistent controller state: the store interface and its SQLite implementation.

``EpochStore`` is the contract the controller's epoch manager types against (a
replicated store, e.g. on etcd, implements the same one): epochs (``current``,
``epoch``, ``by_request``, ``commit``), the reconfiguration journal (``begin``,
``advance``, ``abandon``, ``pending``), and the outcomes of idempotent requests
(``record_outcome``, ``outcome``; an epoch's outcome is written by its ``commit``).

``Store`` is the embedded default: SQLite (WAL, one transaction per state change);
blocking sqlite3 calls run in a worker thread, callers use the async methods.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from orchestrrl import errors
from orchestrrl.model import Circuit, Phase

SCHEMA_VERSION = 4
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS epochs (
    epoch        INTEGER PRIMARY KEY,
    phase        TEXT NOT NULL,
    circuits     TEXT NOT NULL,   -- JSON {ocs: [a0, b0, a1, b1, ...]} (v2: [[ocs, a, b], ...])
    added        TEXT NOT NULL,
    removed      TEXT NOT NULL,
    stages       TEXT NOT NULL,   -- JSON {stage: seconds}
    committed_at REAL NOT NULL,
    request_id   TEXT,
    missing      TEXT NOT NULL DEFAULT '[]'  -- v4: JSON [[pod_a, pod_b, circuits], ...]
);
CREATE UNIQUE INDEX IF NOT EXISTS epochs_request_id ON epochs(request_id)
    WHERE request_id IS NOT NULL;
-- The reconfiguration in progress (at most one row): written before the first
-- switch is touched, advanced at every stage, removed by the commit or rollback.
CREATE TABLE IF NOT EXISTS pending (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    epoch      INTEGER NOT NULL,
    phase      TEXT NOT NULL,
    circuits   TEXT NOT NULL,
    added      TEXT NOT NULL,
    removed    TEXT NOT NULL,
    stage      TEXT NOT NULL,
    request_id TEXT,
    started_at REAL NOT NULL,
    missing    TEXT NOT NULL DEFAULT '[]'
);
-- v4: the outcome of every phase request that carried a request id and succeeded,
-- committed or not (nothing to change, gated, drift repaired): a retry returns it.
CREATE TABLE IF NOT EXISTS outcomes (
    request_id  TEXT PRIMARY KEY,
    phase       TEXT NOT NULL,
    epoch       INTEGER NOT NULL,  -- the epoch the answer named
    changed     INTEGER NOT NULL,
    gated       INTEGER NOT NULL,
    message     TEXT NOT NULL,
    explanation TEXT NOT NULL,
    recorded_at REAL NOT NULL
);
-- What the compute-scheduling loop learnt that outlives a step (one row, opaque to the
-- store: fabric_controller.scheduling.memory_blob). Added without a schema version:
-- controllers that do not know it leave it alone.
CREATE TABLE IF NOT EXISTS schedule_memory (
    id       INTEGER PRIMARY KEY CHECK (id = 1),
    blob     BLOB NOT NULL,
    saved_at REAL NOT NULL
);
"""
# Columns v4 added to tables of older files (ALTER TABLE, see Store._upgrade).
_V4_COLUMNS = {
    "epochs": "missing TEXT NOT NULL DEFAULT '[]'",
    "pending": "missing TEXT NOT NULL DEFAULT '[]'",
}

# Circuits a phase lacks because OCS ports are down: (pod_a, pod_b, circuits), pod_a <
# pod_b, sorted; empty when the phase got every circuit its plan asks for.
Missing = tuple[tuple[str, str, int], ...]


@dataclass(frozen=True)
class EpochRecord:
    """A committed desired state of the fabric."""

    epoch: int
    phase: Phase | None
    circuits: frozenset[Circuit]
    added: frozenset[Circuit]
    removed: frozenset[Circuit]
    stages: dict[str, float]
    committed_at: float
    request_id: str | None = None
    missing: Missing = ()  # circuits the phase lacks because OCS ports were down

    @property
    def degraded(self) -> bool:
        return bool(self.missing)


GENESIS = EpochRecord(0, None, frozenset(), frozenset(), frozenset(), {}, 0.0)


@dataclass(frozen=True)
class PendingRecord:
    """A reconfiguration that started but was neither committed nor rolled back."""

    epoch: int
    phase: Phase
    circuits: frozenset[Circuit]
    added: frozenset[Circuit]
    removed: frozenset[Circuit]
    stage: str
    request_id: str | None
    started_at: float
    missing: Missing = ()


@dataclass(frozen=True)
class RequestOutcome:
    """What a phase request with a ``request_id`` answered: a retry with the same id
    gets this answer again (and the epoch it named), never a new change."""

    request_id: str
    phase: Phase
    epoch: int
    changed: bool
    gated: bool
    message: str
    explanation: str
    recorded_at: float


class EpochStore(Protocol):
    """What the controller needs from its state store: exactly the calls it makes.

    Every method is one atomic state change or one consistent read: a reader never sees
    half of a write, and a write either happens completely or not at all (then it
    raises, and the state is as before). Reads see every write that returned before
    them (read-your-writes across the whole store, also for a replicated one: a
    linearizable read). Storage failures raise an ``orchestrrl.errors.OrlError``
    subclass with a message naming the store (SQLite: ``FailedPrecondition``; a
    replicated store without quorum: ``Unavailable``), never a library exception.

    Invariants the controller relies on:

    - committed epochs are numbered 1, 2, 3, ... without gaps; epoch 0 is ``GENESIS``
      (no phase, no circuits) and is never stored; a committed epoch never changes;
    - the journal holds at most one ``PendingRecord`` (the reconfiguration in
      progress); it is written before the first switch is touched and cleared by the
      commit of its epoch (same transaction) or by ``abandon``;
    - a request id has at most one ``RequestOutcome``, the first recorded; it never
      changes afterwards.

    Node registrations are not part of the store today: the controller keeps them in
    memory (``fabric_controller.registry``) and agents re-register after a restart.
    """

    @property
    def location(self) -> str:
        """Where the state lives, for logs and messages (a file path; endpoints and key
        prefix for a replicated store)."""
        ...

    async def current(self) -> EpochRecord:
        """The newest committed epoch (``GENESIS`` when none is)."""
        ...

    async def epoch(self, epoch: int) -> EpochRecord:
        """Committed epoch ``epoch`` (0: ``GENESIS``); ``errors.NotFound`` naming the
        epoch if it is not stored."""
        ...

    async def by_request(self, request_id: str) -> EpochRecord | None:
        """The committed epoch whose ``request_id`` is ``request_id``, or None."""
        ...

    async def commit(
        self, record: EpochRecord, outcome: RequestOutcome | None = None
    ) -> EpochRecord:
        """In one transaction: check that ``record.epoch`` is the newest committed epoch
        + 1 (else ``errors.Aborted`` naming both, nothing written: another writer got
        there first), store ``record``, store ``outcome`` (the answer to the request
        that made the epoch) unless its request id has one already (the first stays),
        and clear the journal. Returns ``record``."""
        ...

    async def outcome(self, request_id: str) -> RequestOutcome | None:
        """The recorded outcome of ``request_id``, or None if none succeeded with it."""
        ...

    async def record_outcome(self, outcome: RequestOutcome) -> RequestOutcome:
        """In one transaction: store the outcome of a request that committed no epoch
        (nothing to change, gated, drift repaired) unless its id has one already.
        Returns the outcome recorded for the id (the first one wins). A failed request
        is never recorded: its retry is a fresh attempt."""
        ...

    async def pending(self) -> PendingRecord | None:
        """The journal: the reconfiguration begun and neither committed nor abandoned,
        with the last stage it reached; None when none is in progress."""
        ...

    async def begin(self, p: PendingRecord) -> None:
        """In one transaction: make ``p`` the journal (replacing any earlier
        entry). Returns only once durable: the switches are touched after it."""
        ...

    async def advance(self, stage: str) -> None:
        """In one transaction: set the journal's stage to ``stage`` (nothing if the
        journal is empty). Returns only once durable."""
        ...

    async def abandon(self) -> None:
        """In one transaction: clear the journal (nothing if it is empty); committed
        epochs and outcomes are untouched."""
        ...

    async def schedule_memory(self) -> bytes | None:
        """The compute-scheduling loop's saved memory (opaque bytes), or None."""
        ...

    async def save_schedule_memory(self, blob: bytes) -> None:
        """In one transaction: replace the saved memory with ``blob`` (a leader's write,
        fenced like the others)."""
        ...


def _missing_json(missing: Missing) -> str:
    return json.dumps([list(m) for m in missing], separators=(",", ":"))


def _missing_load(text: str) -> Missing:
    return tuple((str(a), str(b), int(n)) for a, b, n in json.loads(text))


def _circuits_json(cs: frozenset[Circuit]) -> str:
    """Compact: the ports of each OCS's circuits as one flat list of integers, in no
    particular order (half the bytes of a list of [ocs, a, b] triples, and about twice
    as fast to encode: a 2048-circuit epoch takes about a millisecond)."""
    by_ocs: dict[str, list[int]] = defaultdict(list)
    for ocs, a, b in cs:
        ports = by_ocs[ocs]
        ports.append(a)
        ports.append(b)
    return json.dumps(by_ocs, separators=(",", ":"))


def _circuits_load(text: str) -> frozenset[Circuit]:
    data = json.loads(text)
    if isinstance(data, list):  # schema v2 rows: [[ocs, a, b], ...]
        return frozenset(Circuit(o, a, b) for o, a, b in data)
    return frozenset(
        Circuit(ocs, ports[i], ports[i + 1])
        for ocs, ports in data.items()
        for i in range(0, len(ports), 2)
    )


class Store:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        # encodings of the circuit sets written last, by identity: a commit stores the
        # very sets its pending row did, so they are encoded once per change
        self._encoded: list[tuple[frozenset[Circuit], str]] = []
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: every transaction survives a crash of the process
            # (kill -9); a power loss may drop the last ones, and recovery then
            # converges the switches to the epoch before them.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._check_version()  # refuses a newer file before anything is written
            self._upgrade()
        except sqlite3.Error as exc:
            raise errors.FailedPrecondition(f"state file {self.path!r}: {exc}") from None

    def _upgrade(self) -> None:
        """Bring tables of a file written before v4 up to v4 in one transaction: the
        added columns, and the outcomes of the request ids its epochs committed."""
        added = []
        for table, column in _V4_COLUMNS.items():
            names = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if column.split()[0] not in names:
                added.append(f"ALTER TABLE {table} ADD COLUMN {column}")
        if not added:
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for sql in added:
                self._db.execute(sql)
            self._db.execute(
                "INSERT OR IGNORE INTO outcomes SELECT request_id, phase, epoch, 1, 0, "
                "'epoch ' || epoch || ': phase ' || phase, '', committed_at "
                "FROM epochs WHERE request_id IS NOT NULL"
            )
            self._db.execute("COMMIT")
        except sqlite3.Error:
            self._db.execute("ROLLBACK")
            raise

    def _check_version(self) -> None:
        row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
        elif int(row[0]) in (1, 2, 3):
            # v2 added the pending table (created above); v3 encodes circuits compactly
            # and still reads the rows written before (see _circuits_load); v4 added the
            # outcomes table and the missing columns (see _upgrade)
            self._db.execute(
                "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
            )
        elif int(row[0]) != SCHEMA_VERSION:
            raise errors.FailedPrecondition(
                f"state file {self.path!r} has schema version {row[0]}, "
                f"this controller reads version {SCHEMA_VERSION}"
            )

    def _json(self, cs: frozenset[Circuit]) -> str:
        for known, text in self._encoded:
            if known is cs:
                return text
        text = _circuits_json(cs)
        self._encoded = [*self._encoded[-5:], (cs, text)]
        return text

    @property
    def location(self) -> str:
        """The state file's path."""
        return self.path

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- synchronous core (runs in a worker thread) --

    def _row(self, where: str, args: tuple[object, ...]) -> EpochRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT epoch, phase, circuits, added, removed, stages, committed_at, request_id, "
                f"missing FROM epochs {where}",
                args,
            ).fetchone()
        if row is None:
            return None
        return EpochRecord(
            epoch=row[0],
            phase=Phase(row[1]),
            circuits=_circuits_load(row[2]),
            added=_circuits_load(row[3]),
            removed=_circuits_load(row[4]),
            stages=json.loads(row[5]),
            committed_at=row[6],
            request_id=row[7],
            missing=_missing_load(row[8]),
        )

    def current_sync(self) -> EpochRecord:
        return self._row("ORDER BY epoch DESC LIMIT 1", ()) or GENESIS

    def by_request_sync(self, request_id: str) -> EpochRecord | None:
        return self._row("WHERE request_id = ?", (request_id,))

    def epoch_sync(self, epoch: int) -> EpochRecord:
        if epoch == 0:
            return GENESIS
        record = self._row("WHERE epoch = ?", (epoch,))
        if record is None:
            raise errors.NotFound(f"epoch {epoch} is not in the state file {self.path!r}")
        return record

    def outcome_sync(self, request_id: str) -> RequestOutcome | None:
        with self._lock:
            row = self._db.execute(
                "SELECT request_id, phase, epoch, changed, gated, message, explanation, "
                "recorded_at FROM outcomes WHERE request_id = ?",
                (request_id,),
            ).fetchone()
        if row is None:
            return None
        return RequestOutcome(
            request_id=row[0],
            phase=Phase(row[1]),
            epoch=row[2],
            changed=bool(row[3]),
            gated=bool(row[4]),
            message=row[5],
            explanation=row[6],
            recorded_at=row[7],
        )

    def _insert_outcome(self, o: RequestOutcome) -> None:
        """Within a transaction; the first outcome of an id stays (a retry never
        replaces it)."""
        self._db.execute(
            "INSERT OR IGNORE INTO outcomes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (o.request_id, o.phase.value, o.epoch, int(o.changed), int(o.gated), o.message,
             o.explanation, o.recorded_at),
        )  # fmt: skip

    def record_outcome_sync(self, outcome: RequestOutcome) -> RequestOutcome:
        """Record ``outcome`` unless its id has one already; returns the one recorded."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._insert_outcome(outcome)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise errors.FailedPrecondition(f"state file {self.path!r}: {exc}") from None
        recorded = self.outcome_sync(outcome.request_id)
        assert recorded is not None
        return recorded

    def pending_sync(self) -> PendingRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT epoch, phase, circuits, added, removed, stage, request_id, started_at, "
                "missing FROM pending WHERE id = 1"
            ).fetchone()
        if row is None:
            return None
        return PendingRecord(
            epoch=row[0],
            phase=Phase(row[1]),
            circuits=_circuits_load(row[2]),
            added=_circuits_load(row[3]),
            removed=_circuits_load(row[4]),
            stage=row[5],
            request_id=row[6],
            started_at=row[7],
            missing=_missing_load(row[8]),
        )

    def _write(self, sql: str, args: tuple[object, ...]) -> None:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(sql, args)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise errors.FailedPrecondition(f"state file {self.path!r}: {exc}") from None

    def begin_sync(self, p: PendingRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO pending VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                p.epoch,
                p.phase.value,
                self._json(p.circuits),
                self._json(p.added),
                self._json(p.removed),
                p.stage,
                p.request_id,
                p.started_at,
                _missing_json(p.missing),
            ),
        )

    def advance_sync(self, stage: str) -> None:
        self._write("UPDATE pending SET stage = ? WHERE id = 1", (stage,))

    def abandon_sync(self) -> None:
        self._write("DELETE FROM pending WHERE id = 1", ())

    def schedule_memory_sync(self) -> bytes | None:
        with self._lock:
            row = self._db.execute("SELECT blob FROM schedule_memory WHERE id = 1").fetchone()
        return None if row is None else bytes(row[0])

    def save_schedule_memory_sync(self, blob: bytes) -> None:
        self._write("INSERT OR REPLACE INTO schedule_memory VALUES (1, ?, ?)", (blob, time.time()))

    def commit_sync(
        self, record: EpochRecord, outcome: RequestOutcome | None = None
    ) -> EpochRecord:
        """Insert the epoch, record the ``outcome`` of the request that made it (if it
        had an id) and clear the pending row, in one transaction."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                (last,) = self._db.execute("SELECT COALESCE(MAX(epoch), 0) FROM epochs").fetchone()
                if record.epoch != last + 1:
                    self._db.execute("ROLLBACK")
                    raise errors.Aborted(
                        f"epoch {record.epoch} cannot follow epoch {last} (another writer?)"
                    )
                assert record.phase is not None
                self._db.execute(
                    "INSERT INTO epochs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        record.epoch,
                        record.phase.value,
                        self._json(record.circuits),
                        self._json(record.added),
                        self._json(record.removed),
                        json.dumps(record.stages),
                        record.committed_at,
                        record.request_id,
                        _missing_json(record.missing),
                    ),
                )
                if outcome is not None:
                    self._insert_outcome(outcome)
                self._db.execute("DELETE FROM pending WHERE id = 1")
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise errors.FailedPrecondition(f"state file {self.path!r}: {exc}") from None
        return record

    # -- async API --

    async def current(self) -> EpochRecord:
        return await asyncio.to_thread(self.current_sync)

    async def by_request(self, request_id: str) -> EpochRecord | None:
        return await asyncio.to_thread(self.by_request_sync, request_id)

    async def epoch(self, epoch: int) -> EpochRecord:
        """A committed epoch by number (0: the genesis); NotFound if it is not stored."""
        return await asyncio.to_thread(self.epoch_sync, epoch)

    async def commit(
        self, record: EpochRecord, outcome: RequestOutcome | None = None
    ) -> EpochRecord:
        return await asyncio.to_thread(self.commit_sync, record, outcome)

    async def outcome(self, request_id: str) -> RequestOutcome | None:
        """The recorded outcome of a request id, or None if none succeeded with it."""
        return await asyncio.to_thread(self.outcome_sync, request_id)

    async def record_outcome(self, outcome: RequestOutcome) -> RequestOutcome:
        """Durably record the outcome of a request that committed no epoch (nothing to
        change, gated, drift repaired); the first outcome of an id wins and is returned.
        A failed request is never recorded: its retry is a fresh attempt."""
        return await asyncio.to_thread(self.record_outcome_sync, outcome)

    async def pending(self) -> PendingRecord | None:
        return await asyncio.to_thread(self.pending_sync)

    async def begin(self, p: PendingRecord) -> None:
        await asyncio.to_thread(self.begin_sync, p)

    async def advance(self, stage: str) -> None:
        await asyncio.to_thread(self.advance_sync, stage)

    async def abandon(self) -> None:
        await asyncio.to_thread(self.abandon_sync)

    async def schedule_memory(self) -> bytes | None:
        return await asyncio.to_thread(self.schedule_memory_sync)

    async def save_schedule_memory(self, blob: bytes) -> None:
        await asyncio.to_thread(self.save_schedule_memory_sync, blob)
