"""The controller's SQLite state: compact circuit encoding, older files, journal."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from fabric_controller.store import (
    SCHEMA_VERSION,
    EpochRecord,
    PendingRecord,
    RequestOutcome,
    Store,
)
from orchestrrl import errors
from orchestrrl.model import Circuit, Phase

pytestmark = pytest.mark.component

CIRCUITS = frozenset({Circuit("ocs0", 1, 9), Circuit("ocs0", 2, 10), Circuit("ocs1", 3, 4)})


def record(epoch: int, circuits: frozenset[Circuit] = CIRCUITS) -> EpochRecord:
    return EpochRecord(
        epoch, Phase.TRAINING, circuits, circuits, frozenset(), {"plan": 0.5}, 1.0, f"r{epoch}"
    )


async def test_epochs_and_the_journal_round_trip_compactly(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    try:
        pending = PendingRecord(1, Phase.TRAINING, CIRCUITS, CIRCUITS, frozenset(), "planned",
                                "r1", 0.5)  # fmt: skip
        await store.begin(pending)
        await store.advance("ocs_programmed")
        got = await store.pending()
        assert got is not None and got.circuits == CIRCUITS and got.stage == "ocs_programmed"
        await store.commit(record(1))
        assert await store.pending() is None
        assert await store.current() == record(1)
        assert await store.by_request("r1") == record(1)
    finally:
        store.close()
    db = sqlite3.connect(tmp_path / "s.db")
    (text,) = db.execute("SELECT circuits FROM epochs WHERE epoch = 1").fetchone()
    db.close()
    stored = json.loads(text)  # one flat list of ports per OCS
    assert sorted(stored) == ["ocs0", "ocs1"] and sorted(stored["ocs0"]) == [1, 2, 9, 10]


# The tables as schema versions 2 and 3 wrote them (v4 added columns and a table).
V3_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE epochs (epoch INTEGER PRIMARY KEY, phase TEXT NOT NULL, circuits TEXT NOT NULL,
    added TEXT NOT NULL, removed TEXT NOT NULL, stages TEXT NOT NULL,
    committed_at REAL NOT NULL, request_id TEXT);
CREATE UNIQUE INDEX epochs_request_id ON epochs(request_id) WHERE request_id IS NOT NULL;
CREATE TABLE pending (id INTEGER PRIMARY KEY CHECK (id = 1), epoch INTEGER NOT NULL,
    phase TEXT NOT NULL, circuits TEXT NOT NULL, added TEXT NOT NULL, removed TEXT NOT NULL,
    stage TEXT NOT NULL, request_id TEXT, started_at REAL NOT NULL);
"""


@pytest.mark.parametrize("version", [2, 3])
async def test_an_older_file_is_read_and_upgraded(tmp_path: Path, version: int) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(V3_SCHEMA)
    db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(version),))
    old = json.dumps([[c.ocs, c.a, c.b] for c in sorted(CIRCUITS)])
    db.execute(
        "INSERT INTO epochs VALUES (1, 'weight-sync', ?, ?, '[]', '{}', 2.0, 'old-1')", (old, old)
    )
    db.execute(
        "INSERT INTO pending VALUES (1, 2, 'training', '{}', '{}', ?, 'planned', NULL, 3.0)",
        (old,),
    )
    db.commit()
    db.close()
    store = Store(path)
    try:
        cur = await store.current()
        assert (cur.epoch, cur.phase, cur.circuits, cur.added, cur.missing) == (
            1, Phase.WEIGHT_SYNC, CIRCUITS, CIRCUITS, ()
        )  # fmt: skip
        pending = await store.pending()
        assert pending is not None and (pending.epoch, pending.missing) == (2, ())
        # the request id its epoch committed has an outcome: a retry replays it
        outcome = await store.outcome("old-1")
        assert outcome is not None and (outcome.phase, outcome.epoch) == (Phase.WEIGHT_SYNC, 1)
        await store.commit(record(2, frozenset()))  # new rows in the compact form
        assert (await store.current()).epoch == 2 and await store.pending() is None
    finally:
        store.close()
    db = sqlite3.connect(path)
    (version,) = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    db.close()
    assert int(version) == SCHEMA_VERSION == 4


async def test_outcomes_and_degraded_epochs_are_durable(tmp_path: Path) -> None:
    """Every successful outcome of a request id is kept across a restart (the first one
    wins); an epoch committed with its outcome stores both in one transaction."""
    store = Store(tmp_path / "s.db")
    try:
        degraded = replace(record(1), missing=(("train0", "train1", 2),))
        first = RequestOutcome("r1", Phase.TRAINING, 1, True, False, "epoch 1", "why", 1.0)
        await store.commit(degraded, first)
        kept = RequestOutcome("x2", Phase.TRAINING, 1, False, False, "nothing to change", "", 2.0)
        assert await store.record_outcome(kept) == kept
        later = replace(kept, phase=Phase.GENERATION, message="second")
        assert await store.record_outcome(later) == kept  # the first outcome stays
    finally:
        store.close()
    store = Store(tmp_path / "s.db")
    try:
        assert await store.outcome("r1") == first
        assert await store.outcome("x2") == kept
        assert await store.outcome("nope") is None
        got = await store.epoch(1)
        assert got.missing == (("train0", "train1", 2),) and got.degraded
        assert (await store.epoch(0)).epoch == 0
        with pytest.raises(errors.NotFound, match="epoch 7"):
            await store.epoch(7)
    finally:
        store.close()


def test_a_newer_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    with pytest.raises(errors.FailedPrecondition, match="schema version 99"):
        Store(path)


async def test_an_epoch_out_of_order_is_aborted(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    try:
        with pytest.raises(errors.Aborted, match="epoch 2 cannot follow epoch 0"):
            await store.commit(record(2))
        assert (await store.current()).epoch == 0
    finally:
        store.close()
