"""The epoch manager alone: ``EpochManager`` over the switch I/O (a real simulated OCS
server) and an in-memory ``EpochStore`` written here against the Protocol, so that the
manager is seen to need nothing of SQLite; no agents, no liveness loop, no gRPC API."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import pytest

from fabric_controller.drivers.ocs import GrpcOcsDriver
from fabric_controller.epochs import EpochManager
from fabric_controller.events import EventHub
from fabric_controller.metrics import ControllerMetrics
from fabric_controller.store import GENESIS, EpochRecord, EpochStore, PendingRecord, RequestOutcome
from fabric_controller.switches import Switches
from orchestrrl import errors
from orchestrrl.model import Circuit, Phase, Wiring
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import serve as serve_ocs

pytestmark = pytest.mark.component


class MemoryStore:
    """The ``EpochStore`` contract in a few dicts (every method is atomic: no awaits)."""

    def __init__(self) -> None:
        self.epochs: dict[int, EpochRecord] = {}
        self.outcomes: dict[str, RequestOutcome] = {}
        self.journal: PendingRecord | None = None
        self.memory: bytes | None = None

    @property
    def location(self) -> str:
        return "memory"

    async def current(self) -> EpochRecord:
        return self.epochs[max(self.epochs)] if self.epochs else GENESIS

    async def epoch(self, epoch: int) -> EpochRecord:
        if epoch == 0:
            return GENESIS
        if epoch not in self.epochs:
            raise errors.NotFound(f"epoch {epoch} is not in memory")
        return self.epochs[epoch]

    async def by_request(self, request_id: str) -> EpochRecord | None:
        return next((r for r in self.epochs.values() if r.request_id == request_id), None)

    async def commit(
        self, record: EpochRecord, outcome: RequestOutcome | None = None
    ) -> EpochRecord:
        last = max(self.epochs, default=0)
        if record.epoch != last + 1:
            raise errors.Aborted(f"epoch {record.epoch} cannot follow epoch {last}")
        self.epochs[record.epoch] = record
        if outcome is not None:
            self.outcomes.setdefault(outcome.request_id, outcome)
        self.journal = None
        return record

    async def outcome(self, request_id: str) -> RequestOutcome | None:
        return self.outcomes.get(request_id)

    async def record_outcome(self, outcome: RequestOutcome) -> RequestOutcome:
        return self.outcomes.setdefault(outcome.request_id, outcome)

    async def pending(self) -> PendingRecord | None:
        return self.journal

    async def begin(self, p: PendingRecord) -> None:
        self.journal = p

    async def advance(self, stage: str) -> None:
        if self.journal is not None:
            self.journal = replace(self.journal, stage=stage)

    async def abandon(self) -> None:
        self.journal = None

    async def schedule_memory(self) -> bytes | None:
        return self.memory

    async def save_schedule_memory(self, blob: bytes) -> None:
        self.memory = blob


class Crash(Exception):
    """The process died at a journaled stage (raised by the fault hook)."""


@dataclass
class Rig:
    wiring: Wiring
    store: MemoryStore
    switches: Switches
    sim: SimulatedOcs

    def manager(
        self,
        down_pods: Callable[[], frozenset[str]] = frozenset,
        crash_at: list[str] | None = None,
    ) -> EpochManager:
        def fault(stage: str) -> None:  # crashes at the stages put into ``crash_at``
            if crash_at is not None and stage in crash_at:
                raise Crash(stage)

        store: EpochStore = self.store  # the manager types against the Protocol
        return EpochManager(
            self.wiring, store, self.switches, EventHub(time.time), ControllerMetrics(),
            down_pods=down_pods, wall_clock=time.time, monotonic=time.monotonic,
            fault_hook=fault,
        )  # fmt: skip

    def held(self) -> frozenset[Circuit]:
        return frozenset(Circuit("ocs0", a, b) for a, b in self.sim.cross_connects())


@pytest.fixture
async def rig(example_wiring: Wiring) -> AsyncIterator[Rig]:
    server, sim = await serve_ocs("127.0.0.1:0", port_count=32, switching_time_s=0.0)
    driver = GrpcOcsDriver("ocs0", server.address, timeout_s=5.0)
    try:
        yield Rig(example_wiring, MemoryStore(), Switches(example_wiring, {"ocs0": driver}), sim)
    finally:
        await driver.close()
        await server.stop(0)


async def test_a_phase_change_is_journaled_programmed_and_committed(rig: Rig) -> None:
    m = rig.manager()
    assert await m.start() == GENESIS
    r = await m.set_phase(Phase.TRAINING, "req-1")
    assert r.changed and r.record.epoch == 1 and r.record.circuits
    assert rig.held() == r.record.circuits
    assert list(rig.store.epochs) == [1] and rig.store.journal is None
    # the stored record is the answer's without the commit's own duration
    assert rig.store.epochs[1] == replace(r.record, stages={
        k: v for k, v in r.record.stages.items() if k != "commit"})  # fmt: skip
    assert list(r.record.stages) == ["observe", "plan", "journal", "program_ocs", "verify",
                                     "commit"]  # fmt: skip

    again = await m.set_phase(Phase.TRAINING, "req-1")  # a retry: the first answer
    assert (again.changed, again.record.epoch) == (False, 1)
    assert again.message.startswith("request 'req-1' already applied: epoch 1")
    with pytest.raises(errors.FailedPrecondition, match="already used for phase training"):
        await m.set_phase(Phase.WEIGHT_SYNC, "req-1")
    same = await m.set_phase(Phase.TRAINING, "req-2")
    assert not same.changed and "nothing to change" in same.message
    assert rig.store.outcomes["req-2"].epoch == 1  # recorded on its own


async def test_a_verification_failure_rolls_the_switches_back(rig: Rig) -> None:
    m = rig.manager()
    await m.start()
    first = await m.set_phase(Phase.TRAINING)
    rig.sim.ignore_next_apply()  # the switch acknowledges the batch but does not move
    with pytest.raises(errors.FailedPrecondition) as info:
        await m.set_phase(Phase.WEIGHT_SYNC, "req-x")
    assert "epoch 2 (weight-sync) not committed: stage verify" in str(info.value)
    assert "the fabric is at epoch 1" in str(info.value)
    assert m.current == first.record and rig.held() == first.record.circuits
    assert rig.store.journal is None and "req-x" not in rig.store.outcomes


@pytest.mark.parametrize(("stage", "epoch"), [("planned", 1), ("ocs_programmed", 2)])
async def test_a_restart_after_a_crash_rolls_forward_or_back_by_the_journal(
    rig: Rig, stage: str, epoch: int
) -> None:
    crash_at: list[str] = []
    m = rig.manager(crash_at=crash_at)
    await m.start()
    training = (await m.set_phase(Phase.TRAINING)).record
    crash_at.append(stage)
    with pytest.raises(Crash):
        await m.set_phase(Phase.WEIGHT_SYNC, "req-c")
    assert rig.store.journal is not None and rig.store.journal.stage == stage

    restarted = rig.manager()
    now = await restarted.start()
    assert now.epoch == epoch and rig.store.journal is None
    assert rig.held() == now.circuits
    if epoch == 1:  # journaled before the optics moved: back to training
        assert (now.epoch, now.circuits) == (1, training.circuits)
        assert "req-c" not in rig.store.outcomes
    else:  # every batch acknowledged: committed, and the request's answer recorded
        assert now.phase is Phase.WEIGHT_SYNC and rig.store.outcomes["req-c"].epoch == 2


async def test_drift_is_repaired_to_the_committed_epoch(rig: Rig) -> None:
    m = rig.manager()
    await m.start()
    committed = (await m.set_phase(Phase.TRAINING)).record
    a, b = sorted(rig.sim.cross_connects())[0]
    rig.sim.apply([(a, b)], [])  # someone unplugged a circuit by hand
    msg = await m.reconcile_once()
    assert msg is not None and "switches repaired to epoch 1: +1 -0" in msg
    assert rig.held() == committed.circuits and m.current == committed  # no new epoch


async def test_pods_reported_down_are_left_out_of_the_plan(rig: Rig) -> None:
    m = rig.manager(down_pods=lambda: frozenset({"gen0"}))
    await m.start()
    r = await m.set_phase(Phase.WEIGHT_SYNC)
    pods = {p for c in r.record.circuits for p in rig.wiring.circuit_pods(c)}
    assert "gen0" not in pods and "gen1" in pods
