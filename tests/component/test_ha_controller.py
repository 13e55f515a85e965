"""Controller roles in-process (issue 17): the fencing token on every OCS batch, a lost
term that sends nothing more and leaves its journal to the next leader, the switch's own
refusal of an older token, a store write whose outcome is unknown, and the servicer's
standby answers (the subprocess tests with real etcd: tests/e2e/test_ha_failover.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fabric_controller.controller import Controller
from fabric_controller.drivers.ocs import GrpcOcsDriver
from fabric_controller.epochs import EpochManager
from fabric_controller.events import EventHub
from fabric_controller.leadership import NotLeader, Role
from fabric_controller.metrics import ControllerMetrics
from fabric_controller.servicer import FabricControllerServicer
from fabric_controller.store import EpochRecord, RequestOutcome, Store
from fabric_controller.switches import Switches
from orchestrrl import errors, grpcutil
from orchestrrl.leader import LEADER_METADATA_KEY
from orchestrrl.model import Circuit, Phase, Wiring
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import serve as serve_ocs
from tests.component.test_epochs import MemoryStore

pytestmark = pytest.mark.component


@dataclass
class Rig:
    wiring: Wiring
    driver: GrpcOcsDriver
    sim: SimulatedOcs

    def manager(
        self, role: Role, store: MemoryStore, fault: list[str] | None = None
    ) -> tuple[EpochManager, EventHub]:
        def hook(stage: str) -> None:  # the leadership is lost at the stages in ``fault``
            if fault and stage in fault:
                role.lose(f"deposed at {stage}")

        switches = Switches(self.wiring, {"ocs0": self.driver}, fencing=role.fencing_token)
        events = EventHub(time.time)
        m = EpochManager(
            self.wiring, store, switches, events, ControllerMetrics(),
            wall_clock=time.time, monotonic=time.monotonic, fault_hook=hook, role=role,
        )  # fmt: skip
        return m, events

    def held(self) -> frozenset[Circuit]:
        return frozenset(Circuit("ocs0", a, b) for a, b in self.sim.cross_connects())


@pytest.fixture
async def rig(example_wiring: Wiring) -> AsyncIterator[Rig]:
    server, sim = await serve_ocs("127.0.0.1:0", port_count=32, switching_time_s=0.0)
    driver = GrpcOcsDriver("ocs0", server.address, timeout_s=5.0)
    try:
        yield Rig(example_wiring, driver, sim)
    finally:
        await driver.close()
        await server.stop(0)


def leading(token: int) -> Role:
    role = Role.standby()
    role.lead(token, lambda: True, "10.0.0.1:50051")
    return role


async def test_the_leader_stamps_its_token_and_a_standby_changes_nothing(rig: Rig) -> None:
    role = Role.standby()
    store = MemoryStore()
    m, _ = rig.manager(role, store)
    role.lead(7, lambda: True, "10.0.0.1:50051")
    await m.start()
    r = await m.set_phase(Phase.TRAINING, "t-1")
    assert r.changed and rig.held() == r.record.circuits
    assert rig.sim.fencing.newest == 7  # every batch carried the token
    role.lose("test: lease lost")
    with pytest.raises(NotLeader, match=r"not the leader .*lease lost"):
        await m.set_phase(Phase.WEIGHT_SYNC, "w-1")
    assert rig.held() == r.record.circuits and store.journal is None
    assert (await store.current()).epoch == 1


async def test_a_term_lost_midway_sends_nothing_more_and_the_next_leader_recovers(
    rig: Rig,
) -> None:
    store = MemoryStore()
    old = leading(3)
    m, events = rig.manager(old, store, fault=["planned"])
    await m.start()
    with pytest.raises(NotLeader):
        await m.set_phase(Phase.TRAINING, "t-1")
    assert rig.held() == frozenset() and rig.sim.fencing.newest == 0  # no batch sent
    assert store.journal is not None and store.journal.stage == "planned"  # left as it was
    interrupted = [e for e in events.recent(10) if e.kind == "phase_interrupted"]
    assert interrupted and "no further switch command" in interrupted[0].message

    new = leading(5)  # the next leader, over the same state and switch
    m2, _ = rig.manager(new, store)
    await m2.start()  # recovery: nothing was programmed, rolled back
    assert store.journal is None and (await store.current()).epoch == 0
    r = await m2.set_phase(Phase.TRAINING, "t-1")  # the retry is a fresh change
    assert r.changed and r.record.epoch == 1 and rig.sim.fencing.newest == 5


async def test_the_switch_refuses_an_older_token(rig: Rig) -> None:
    """A leader that believes it still leads (its lease not yet expired by its clock)
    while a newer one programmed the switch: the switch refuses, nothing changes."""
    store = MemoryStore()
    m, _ = rig.manager(leading(4), store)
    await m.start()
    # a newer leader's batches reached the switch (a change, and its undoing: an empty
    # batch would not make its token the newest)
    rig.sim.apply((), ((1, 2),), fencing_token=9)
    rig.sim.apply(((1, 2),), (), fencing_token=9)
    with pytest.raises(errors.FailedPrecondition, match=r"fencing token 4 is older .* 9"):
        await m.set_phase(Phase.TRAINING, "t-1")
    assert rig.held() == frozenset() and (await store.current()).epoch == 0


class UnconfirmedCommit(MemoryStore):
    """A replicated store losing its quorum at the first commit: the write is applied
    (quorum came back later) but the controller hears Unavailable."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next_commit = True

    async def commit(
        self, record: EpochRecord, outcome: RequestOutcome | None = None
    ) -> EpochRecord:
        await super().commit(record, outcome)
        if self.fail_next_commit:
            self.fail_next_commit = False
            raise errors.Unavailable("etcd commit: no quorum answered within 5 s")
        return record


async def test_a_store_write_with_unknown_outcome_is_read_again_before_the_next(
    rig: Rig,
) -> None:
    store = UnconfirmedCommit()
    m, _ = rig.manager(Role(), store)
    await m.start()
    with pytest.raises(errors.Unavailable):
        await m.set_phase(Phase.TRAINING, "t-1")
    retry = await m.set_phase(Phase.TRAINING, "t-1")  # the commit had been applied
    assert (retry.record.epoch, retry.changed) == (1, False)
    nxt = await m.set_phase(Phase.WEIGHT_SYNC, "w-1")  # epoch 2, not "2 cannot follow 0"
    assert nxt.changed and nxt.record.epoch == 2 and rig.held() == nxt.record.circuits


async def test_a_standby_answers_every_call_with_the_leader(
    rig: Rig, example_wiring: Wiring, tmp_path: Path
) -> None:
    role = Role.standby()
    role.leader = "10.0.0.9:50051"
    sqlite = Store(tmp_path / "state.db")
    controller = Controller(example_wiring, sqlite, {"ocs0": rig.driver}, role=role)
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: pb_grpc.add_FabricControllerServicer_to_server(
            FabricControllerServicer(controller), s
        ),
        [],
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = pb_grpc.FabricControllerStub(ch)
            for call in (
                stub.GetPhase(pb.GetPhaseRequest(), timeout=5),
                stub.Heartbeat(pb.HeartbeatRequest(node="gpu-node-0"), timeout=5),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                e = refused.value
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                assert e.details() == "not the leader; the leader is at 10.0.0.9:50051"
                assert dict(e.trailing_metadata() or ())[LEADER_METADATA_KEY] == "10.0.0.9:50051"

            # leading (start-up done): served; a stream open when it steps down gets the
            # stepped_down event, then the standby answer
            await controller.lead(sqlite, 2, lambda: True, "127.0.0.1:1")
            assert (await stub.GetPhase(pb.GetPhaseRequest(), timeout=5)).epoch == 0
            watch = stub.WatchEvents(pb.WatchEventsRequest(follow=True, recent=1), timeout=10)
            kinds: list[str] = []

            async def follow() -> None:
                async for event in watch:
                    kinds.append(event.kind)
                    if event.kind == "leader_elected":  # subscribed: now lose the term
                        role.lose("test: lease lost")

            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await follow()
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert ended.value.details() == "not the leader; no leader elected yet"
            assert kinds == ["leader_elected", "stepped_down"]
    finally:
        await server.stop(0)
        sqlite.close()
