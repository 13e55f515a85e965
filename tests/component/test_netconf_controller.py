"""The epoch manager over a NETCONF OCS: phase changes, a refused batch, a read-back that
differs, and a server killed mid-change, against netconfd (``tests.netconf_fixtures``).
After each, a separate NETCONF session reads what the switch holds."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fabric_controller.epochs import EpochManager
from fabric_controller.events import EventHub
from fabric_controller.metrics import ControllerMetrics
from fabric_controller.store import Store
from fabric_controller.switches import Switches
from orchestrrl import errors
from orchestrrl.model import Circuit, Phase, Wiring
from sim_backends.netconf_faults import MisreadingNetconfDriver
from sim_backends.netconf_server import NetconfServer
from tests.netconf_fixtures import Observer

pytestmark = pytest.mark.component


@dataclass
class Rig:
    wiring: Wiring
    store: Store
    driver: MisreadingNetconfDriver
    observer: Observer
    faults: list[Callable[[str], None]] = field(default_factory=list)

    def manager(self) -> EpochManager:
        switches = Switches(self.wiring, {"ocs0": self.driver})
        return EpochManager(
            self.wiring, self.store, switches, EventHub(time.time), ControllerMetrics(),
            wall_clock=time.time, monotonic=time.monotonic,
        )  # fmt: skip

    def held(self) -> frozenset[Circuit]:
        return frozenset(Circuit("ocs0", a, b) for a, b in self.observer.circuits())


@pytest.fixture
async def rig(
    example_wiring: Wiring, netconf: NetconfServer, observer: Observer, tmp_path: Path
) -> AsyncIterator[Rig]:
    faults: list[Callable[[str], None]] = []

    def fault(stage: str) -> None:
        for f in faults:
            f(stage)

    driver = MisreadingNetconfDriver(
        "ocs0",
        netconf.address,
        netconf.settings(timeout_s=5.0, retries=0),
        switching_time_s=0.01,
        fault_hook=fault,
    )
    store = Store(tmp_path / "state.db")
    try:
        yield Rig(example_wiring, store, driver, observer, faults)
    finally:
        await driver.close()
        store.close()


async def test_phase_changes_program_the_switch_and_the_switch_holds_each_epoch(rig: Rig) -> None:
    m = rig.manager()
    await m.start()
    for i, phase in enumerate(
        (Phase.TRAINING, Phase.WEIGHT_SYNC, Phase.GENERATION, Phase.TRAINING)
    ):
        r = await m.set_phase(phase, f"req-{i}")
        assert r.changed and rig.held() == r.record.circuits
        assert rig.observer.controller()["last-batch"].startswith(f"epoch-{r.record.epoch}-")
    assert m.current.epoch == 4 and len(m.current.circuits) == 8
    assert await m.reconcile_once() == "switches match epoch 4"


async def test_a_batch_the_switch_refuses_leaves_it_and_the_controller_where_they_were(
    rig: Rig,
) -> None:
    m = rig.manager()
    await m.start()
    first = (await m.set_phase(Phase.TRAINING)).record
    # the switch loses port 25 (a line card pulled): the wiring still cables a pod to it
    rig.observer.edit(
        '<ports xmlns="urn:orchestrrl:yang:optical-switch">'
        '<port nc:operation="delete"><port-id>25</port-id></port></ports>'
    )
    with pytest.raises(errors.FailedPrecondition) as info:
        await m.set_phase(Phase.WEIGHT_SYNC, "req-w")
    text = str(info.value)
    assert text.startswith("epoch 2 (weight-sync) not committed: stage program_ocs: OCS 'ocs0' ")
    assert f"(NETCONF {rig.driver.address}): <edit-config> refused by the switch: " in text
    assert "required value instance not found" in text and "='25'" in text
    assert text.endswith("the fabric is at epoch 1")
    assert m.current == first and rig.held() == first.circuits
    assert await rig.store.pending() is None and await rig.store.outcome("req-w") is None


async def test_a_read_back_that_differs_fails_the_change_and_rolls_back(rig: Rig) -> None:
    m = rig.manager()
    await m.start()
    first = (await m.set_phase(Phase.TRAINING)).record
    planned = await m.plan(Phase.WEIGHT_SYNC)
    port = min(c.a for c in planned.circuits.add)
    rig.driver.misread_next(port)  # the switch reports that port's new pair missing
    with pytest.raises(errors.FailedPrecondition) as info:
        await m.set_phase(Phase.WEIGHT_SYNC)
    text = str(info.value)
    assert f"read-back after <commit> differs from the batch (pair ingress {port}: " in text
    assert "the commit was cancelled (<cancel-commit>)" in text
    assert text.endswith("the fabric is at epoch 1") and rig.driver.misread == 1
    assert m.current == first and rig.held() == first.circuits


async def test_the_server_killed_mid_change_is_repaired_to_the_committed_epoch(
    rig: Rig, netconf: NetconfServer
) -> None:
    m = rig.manager()
    await m.start()
    first = (await m.set_phase(Phase.TRAINING)).record

    def kill(stage: str) -> None:  # between the batch's confirmed commit and its confirm
        if stage == "netconf_confirmed":
            rig.faults.clear()
            netconf.kill_netconfd()

    rig.faults.append(kill)
    with pytest.raises(errors.FailedPrecondition) as info:
        await m.set_phase(Phase.WEIGHT_SYNC, "req-k")
    assert "epoch 2 (weight-sync) not committed: stage program_ocs" in str(info.value)
    assert "rollback failed too" in str(info.value)  # the switch is down: it cannot undo
    assert m.current == first and (await rig.store.pending()) is not None

    netconf.start_netconfd()  # it comes back with its last confirmed configuration
    obs = Observer(netconf)
    try:
        assert {Circuit("ocs0", x, y) for x, y in obs.circuits()} == first.circuits
        # and an operator unplugged a circuit meanwhile: the repair puts it back
        a, b = sorted(first.circuits)[0][1:]
        obs.edit(
            '<cross-connects xmlns="urn:orchestrrl:yang:optical-switch">'
            f'<pair nc:operation="delete"><ingress>{a}</ingress></pair>'
            f'<pair nc:operation="delete"><ingress>{b}</ingress></pair></cross-connects>'
        )
        msg = await m.reconcile_once()  # the drift check runs the pending recovery
        assert msg is not None and "rolled back from stage planned" in msg
        assert m.current == first and (await rig.store.pending()) is None
        assert {Circuit("ocs0", x, y) for x, y in obs.circuits()} == first.circuits
        again = await m.set_phase(Phase.WEIGHT_SYNC, "req-k")  # and the fabric moves on
        assert again.record.epoch == 2
        assert {Circuit("ocs0", x, y) for x, y in obs.circuits()} == again.record.circuits
    finally:
        obs.close()
