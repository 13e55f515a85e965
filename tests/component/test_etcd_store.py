"""The controller's state in real etcd: the SQLite store's behaviour, one fenced
transaction per change, conflicting and deposed writers refused, quorum loss."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from fabric_controller.election import Election
from fabric_controller.etcd_store import LAYOUT_VERSION, Etcd, EtcdStore, NotLeader
from fabric_controller.store import EpochRecord, PendingRecord, RequestOutcome
from orchestrrl import errors
from orchestrrl.model import Circuit, Mode, Phase
from sim_backends.etcd_cluster import EtcdCluster

pytest_plugins = ["tests.etcd_fixtures"]
pytestmark = pytest.mark.component

CIRCUITS = frozenset({Circuit("ocs0", 1, 9), Circuit("ocs0", 2, 10), Circuit("ocs1", 3, 4)})


def record(epoch: int, circuits: frozenset[Circuit] = CIRCUITS) -> EpochRecord:
    return EpochRecord(
        epoch, Phase.TRAINING, circuits, circuits, frozenset(), {"plan": 0.5}, 1.0, f"r{epoch}"
    )


def pending(epoch: int) -> PendingRecord:
    return PendingRecord(epoch, Phase.TRAINING, CIRCUITS, CIRCUITS, frozenset(), "planned",
                         f"r{epoch}", 0.5)  # fmt: skip


class Leader:
    """A connection, an election won, and the store fenced with it."""

    def __init__(self, cluster: EtcdCluster, address: str, ttl_s: int = 2, **etcd: float):
        self.etcd = Etcd(cluster.endpoints, **etcd)
        self.election = Election(self.etcd, address, ttl_s=ttl_s)
        self.store: EtcdStore

    async def __aenter__(self) -> Leader:
        await self.election.start()
        fence = await self.election.campaign()
        self.store = (await EtcdStore.open(self.etcd)).fenced(fence)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.election.close()
        await self.etcd.close()


@pytest.fixture
async def leader(etcd1: EtcdCluster) -> AsyncIterator[Leader]:
    async with Leader(etcd1, "10.0.0.1:50051") as lead:
        yield lead


async def test_epochs_and_the_journal_round_trip(leader: Leader) -> None:
    store = leader.store
    assert await store.pending() is None and (await store.current()).epoch == 0
    await store.begin(pending(1))
    await store.advance("ocs_programmed")
    got = await store.pending()
    assert got is not None and got.circuits == CIRCUITS and got.stage == "ocs_programmed"
    assert got == replace(pending(1), stage="ocs_programmed")
    await store.commit(record(1))
    assert await store.pending() is None
    assert await store.current() == record(1)
    assert await store.by_request("r1") == record(1)
    assert await store.by_request("r9") is None
    await store.advance("ignored")  # no journal: nothing to advance (as SQLite's UPDATE)
    assert await store.pending() is None
    # the circuits are encoded as the SQLite store does: one flat list of ports per OCS
    raw = await leader.etcd.run("test", lambda c: c.get(b"/orchestrrl/epochs/000000000001"))
    stored = json.loads(json.loads(raw.value)["circuits"])
    assert sorted(stored) == ["ocs0", "ocs1"] and sorted(stored["ocs0"]) == [1, 2, 9, 10]


async def test_outcomes_and_degraded_epochs_are_durable(etcd1: EtcdCluster) -> None:
    """As the SQLite store: the first outcome of an id wins; an epoch committed with its
    outcome stores both; both are there for the next leader."""
    first = RequestOutcome("r1", Phase.TRAINING, 1, True, False, "epoch 1", "why", 1.0)
    kept = RequestOutcome("x2", Phase.TRAINING, 1, False, False, "nothing to change", "", 2.0)
    degraded = replace(record(1), missing=(("train0", "train1", 2),))
    async with Leader(etcd1, "a:1") as a:
        await a.store.commit(degraded, first)
        assert await a.store.record_outcome(kept) == kept
        later = replace(kept, phase=Phase.GENERATION, message="second")
        assert await a.store.record_outcome(later) == kept  # the first outcome stays
    async with Leader(etcd1, "b:1") as b:
        store = b.store
        assert await store.outcome("r1") == first
        assert await store.outcome("x2") == kept
        assert await store.outcome("nope") is None
        got = await store.epoch(1)
        assert got.missing == (("train0", "train1", 2),) and got.degraded
        assert (await store.epoch(0)).epoch == 0
        with pytest.raises(errors.NotFound, match="epoch 7"):
            await store.epoch(7)


async def test_an_epoch_out_of_order_is_aborted(leader: Leader) -> None:
    with pytest.raises(errors.Aborted, match="epoch 2 cannot follow epoch 0"):
        await leader.store.commit(record(2))
    assert (await leader.store.current()).epoch == 0


async def test_conflicting_commits_of_one_epoch_commit_it_once(leader: Leader) -> None:
    await leader.store.commit(record(1))
    other = replace(record(2), phase=Phase.GENERATION, request_id="other")
    results = await asyncio.gather(
        leader.store.commit(record(2)), leader.store.commit(other), return_exceptions=True
    )
    won = [r for r in results if isinstance(r, EpochRecord)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 1, results
    assert isinstance(lost[0], errors.Aborted) and "epoch 2 cannot follow epoch 2" in str(lost[0])
    assert await leader.store.current() == won[0]
    # the loser's request id was not indexed: the transaction changed nothing
    loser = "other" if won[0].request_id == "r2" else "r2"
    assert await leader.store.by_request(loser) is None


async def test_a_duplicate_request_id_is_refused(leader: Leader) -> None:
    await leader.store.commit(record(1))
    with pytest.raises(errors.FailedPrecondition, match="'r1' already committed epoch 1"):
        await leader.store.commit(replace(record(2), request_id="r1"))
    assert (await leader.store.current()).epoch == 1


async def test_a_deposed_leaders_writes_are_refused(etcd1: EtcdCluster) -> None:
    """Leader A's lease ends without A noticing (as when A is frozen); B is elected and
    commits; every write of A fails with NotLeader and changes nothing."""
    async with Leader(etcd1, "a:1") as a:
        await a.store.commit(record(1))
        await a.store.begin(pending(2))
        old = a.election.token
        await a.etcd.run("revoke", lambda c: c.revoke_lease(a.election.lease))
        async with Leader(etcd1, "b:1") as b:
            assert b.election.token > old
            assert await b.election.leader_address() == "b:1"
            for write in (
                a.store.commit(record(2)),
                a.store.begin(pending(3)),
                a.store.advance("ocs_programmed"),
                a.store.abandon(),
                a.store.record_outcome(
                    RequestOutcome("z", Phase.TRAINING, 1, False, False, "m", "", 1.0)
                ),
                a.store.save_schedule_memory(b"stale memory"),
            ):
                with pytest.raises(NotLeader, match=f"fencing token {old}.*held by b:1"):
                    await write
            assert await b.store.schedule_memory() is None
            assert (await b.store.current()).epoch == 1
            still = await b.store.pending()
            assert still is not None and still.stage == "planned"  # A's advance did nothing
            assert await b.store.outcome("z") is None
            await b.store.commit(record(2))
            assert (await b.store.current()).epoch == 2


async def test_an_unfenced_store_reads_but_does_not_write(leader: Leader) -> None:
    await leader.store.commit(record(1))
    reader = await EtcdStore.open(leader.etcd)
    assert (await reader.current()).epoch == 1
    with pytest.raises(errors.FailedPrecondition, match="not fenced"):
        await reader.begin(pending(2))


async def test_another_layout_version_is_refused(leader: Leader) -> None:
    await leader.etcd.run("test", lambda c: c.put(b"/other/schema", b"99"))
    with pytest.raises(errors.FailedPrecondition, match=r"layout version '99'.*version 1"):
        await EtcdStore.open(leader.etcd, "/other/")
    assert LAYOUT_VERSION == "1"
    with pytest.raises(errors.InvalidArgument, match="etcd prefix"):
        EtcdStore(leader.etcd, "no-slash")
    with pytest.raises(errors.InvalidArgument, match="etcd endpoint"):
        Etcd(["127.0.0.1"])


async def test_quorum_lost_and_regained(etcd3: EtcdCluster) -> None:
    """One member of three down changes nothing; two down make every call fail with
    Unavailable and leave no partial state; service resumes when quorum returns."""
    async with Leader(etcd3, "a:1", ttl_s=60, call_timeout_s=0.5, deadline_s=2.0) as a:
        store = a.store
        etcd3.kill(0)
        await store.begin(pending(1))
        await store.commit(record(1))
        await store.begin(pending(2))
        etcd3.kill(1)
        outcome = RequestOutcome("r2", Phase.TRAINING, 2, True, False, "epoch 2", "", 2.0)
        with pytest.raises(errors.Unavailable, match="no quorum answered within 2 s"):
            await store.commit(record(2), outcome)
        with pytest.raises(errors.Unavailable, match="etcd read the head epoch"):
            await store.current()
        etcd3.restart(0)
        etcd3.restart(1)
        await etcd3.wait_healthy()
        # the unconfirmed commit was applied whole or not at all
        current, journal = await store.current(), await store.pending()
        if current.epoch == 2:
            assert journal is None and await store.outcome("r2") == outcome
        else:
            assert current == record(1) and journal == pending(2)
            assert await store.outcome("r2") is None
        # retrying it is safe either way, and the next epoch commits
        assert await store.commit(record(2), outcome) == record(2)
        await store.commit(record(3))
        assert (await store.current()).epoch == 3 and await store.outcome("r2") == outcome


async def test_the_schedule_memory_is_one_fenced_key(leader: Leader) -> None:
    """The compute-scheduling loop's memory (opaque bytes, up to its 1 MiB bound) is
    written by the leader and read by the next one; an unfenced store only reads it."""
    store = leader.store
    assert await store.schedule_memory() is None
    big = bytes(range(256)) * 4096  # 1 MiB: memory_blob's bound, under etcd's limit
    await store.save_schedule_memory(big)
    await store.save_schedule_memory(big[:-1])  # replaces
    reader = await EtcdStore.open(leader.etcd)
    assert await reader.schedule_memory() == big[:-1]
    with pytest.raises(errors.FailedPrecondition, match="not fenced"):
        await reader.save_schedule_memory(b"x")


async def test_an_async_mode_epoch_is_replicated_like_any_phase(etcd1: EtcdCluster) -> None:
    """The cluster's mode is its committed epoch's phase: a new leader reads it back."""
    async with Leader(etcd1, "10.0.0.1:50051") as first:
        await first.store.commit(replace(record(1), phase=Phase.ASYNC))
    async with Leader(etcd1, "10.0.0.2:50051") as second:
        got = await second.store.current()
        assert (got.epoch, got.phase, got.circuits) == (1, Phase.ASYNC, CIRCUITS)
        assert Mode.of(got.phase) is Mode.ASYNC
