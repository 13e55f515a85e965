"""The controller's SQLite state: compact circuit encoding, older files, journal."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from fabric_controller.store import SCHEMA_VERSION, EpochRecord, PendingRecord, Store
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


async def test_a_version_2_file_is_read_and_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    Store(path).close()
    db = sqlite3.connect(path)
    old = json.dumps([[c.ocs, c.a, c.b] for c in sorted(CIRCUITS)])
    db.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    db.execute(
        "INSERT INTO epochs VALUES (1, 'weight-sync', ?, ?, '[]', '{}', 2.0, NULL)", (old, old)
    )
    db.commit()
    db.close()
    store = Store(path)
    try:
        cur = await store.current()
        assert (cur.epoch, cur.phase, cur.circuits, cur.added) == (
            1, Phase.WEIGHT_SYNC, CIRCUITS, CIRCUITS
        )  # fmt: skip
        await store.commit(record(2, frozenset()))  # new rows in the compact form
        assert (await store.current()).epoch == 2
    finally:
        store.close()
    db = sqlite3.connect(path)
    (version,) = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    db.close()
    assert int(version) == SCHEMA_VERSION == 3


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
