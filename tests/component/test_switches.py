"""Switch I/O alone: ``Switches`` against a real simulated OCS server (gRPC on
127.0.0.1:0), with no controller, store or planner state around it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import pytest
from structlog.testing import capture_logs

from fabric_controller.drivers.ocs import GrpcOcsDriver, OcsInfo, PortPair
from fabric_controller.switches import StageError, Switches
from orchestrrl import errors
from orchestrrl.model import Circuit, Phase, Wiring
from scheduler.network import plan_phase_circuits
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import serve as serve_ocs

pytestmark = pytest.mark.component


@dataclass
class Rig:
    switches: Switches
    sim: SimulatedOcs
    driver: GrpcOcsDriver


@pytest.fixture
async def rig(example_wiring: Wiring) -> AsyncIterator[Rig]:
    (ocs,) = example_wiring.ocses
    server, sim = await serve_ocs("127.0.0.1:0", name=ocs.name, port_count=ocs.ports,
                                  switching_time_s=0.0)  # fmt: skip
    driver = GrpcOcsDriver(ocs.name, server.address, timeout_s=5.0)
    try:
        yield Rig(Switches(example_wiring, {ocs.name: driver}), sim, driver)
    finally:
        await driver.close()
        await server.stop(0)


def phase(wiring: Wiring, p: Phase) -> frozenset[Circuit]:
    return plan_phase_circuits(wiring, p, frozenset(), frozenset()).circuits.desired


def held(rig: Rig) -> frozenset[Circuit]:
    return frozenset(Circuit(rig.driver.name, a, b) for a, b in rig.sim.cross_connects())


def test_a_wiring_with_a_switch_without_a_driver_is_refused(example_wiring: Wiring) -> None:
    with pytest.raises(errors.FailedPrecondition, match="no driver for OCS ocs0"):
        Switches(example_wiring, {})


async def test_converge_programs_exactly_the_target_and_again_changes_nothing(
    rig: Rig, example_wiring: Wiring
) -> None:
    training = phase(example_wiring, Phase.TRAINING)
    sync = phase(example_wiring, Phase.WEIGHT_SYNC)
    plan = await rig.switches.converge(training, "t1")
    assert plan.add == training and not plan.remove and held(rig) == training
    assert await rig.switches.observe() == (training, frozenset())
    assert (await rig.switches.converge(training, "t2")).empty  # idempotent

    plan = await rig.switches.converge(sync, "t3")
    assert plan.add == sync - training and plan.remove == training - sync
    assert held(rig) == sync
    rig.sim.set_port_health(next(iter(sync)).a, up=False)
    _, down = await rig.switches.observe()
    assert down == {(rig.driver.name, next(iter(sync)).a)}


async def test_a_refused_batch_is_a_program_ocs_stage_error_naming_the_switch(
    rig: Rig, example_wiring: Wiring
) -> None:
    rig.sim.fail_next_apply("laser fault")
    with pytest.raises(StageError) as info:
        await rig.switches.converge(phase(example_wiring, Phase.TRAINING), "t")
    assert info.value.stage == "program_ocs"
    assert (
        "OCS 'ocs0' refused the batch" in info.value.detail and "laser fault" in info.value.detail
    )
    assert held(rig) == frozenset()


async def test_a_batch_acknowledged_but_not_applied_fails_verification(
    rig: Rig, example_wiring: Wiring
) -> None:
    rig.sim.ignore_next_apply()
    with pytest.raises(StageError) as info:
        await rig.switches.converge(phase(example_wiring, Phase.TRAINING), "t")
    assert info.value.stage == "verify"
    assert "switch state differs from the plan" in info.value.detail


class LostAnswer:
    """A driver whose next apply reaches the switch but whose answer is lost."""

    def __init__(self, inner: GrpcOcsDriver, apply_first: bool) -> None:
        self.inner = inner
        self.name = inner.name
        self.apply_first = apply_first

    async def info(self) -> OcsInfo:
        return await self.inner.info()

    async def cross_connects(self) -> frozenset[PortPair]:
        return await self.inner.cross_connects()

    async def snapshot(self) -> tuple[frozenset[PortPair], frozenset[int]]:
        return await self.inner.snapshot()

    async def apply(
        self, disconnect: Iterable[PortPair], connect: Iterable[PortPair], request_id: str = ""
    ) -> frozenset[PortPair]:
        if self.apply_first:
            await self.inner.apply(disconnect, connect, request_id=request_id)
        raise errors.Unavailable(f"OCS {self.name!r}: ApplyBatch: DEADLINE_EXCEEDED")

    async def close(self) -> None:
        await self.inner.close()


@pytest.mark.parametrize("applied", [True, False])
async def test_a_lost_answer_is_settled_by_the_switch_table(
    rig: Rig, example_wiring: Wiring, applied: bool
) -> None:
    training = phase(example_wiring, Phase.TRAINING)
    switches = Switches(example_wiring, {rig.driver.name: LostAnswer(rig.driver, applied)})
    with capture_logs() as logs:
        if applied:
            assert (await switches.converge(training, "t")).add == training
            assert held(rig) == training
        else:
            with pytest.raises(StageError, match="did not confirm the batch") as info:
                await switches.converge(training, "t")
            assert info.value.stage == "program_ocs" and held(rig) == frozenset()
    lost = [e for e in logs if e["event"] == "ocs_answer_lost_batch_applied"]
    assert len(lost) == (1 if applied else 0)


async def test_switching_time_is_the_slowest_switch_of_each_step(
    rig: Rig, example_wiring: Wiring
) -> None:
    from fabric_controller.reconcile import converge, steps

    training = phase(example_wiring, Phase.TRAINING)
    plan_steps = steps(converge(example_wiring, frozenset(), training))
    per_step = example_wiring.ocs("ocs0").switching_time_s
    assert rig.switches.switching_time(plan_steps) == pytest.approx(per_step * len(plan_steps))
    assert rig.switches.switching_time([]) == 0.0
