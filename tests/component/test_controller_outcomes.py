"""What a phase request answers and keeps: request-id outcomes (replayed, durable, refused
for another phase), degraded phases when OCS ports are down and their restoration when
the ports come back, and recovery that rolls forward when the switches already hold the
interrupted epoch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fabric_controller import cli
from orchestrrl import errors
from orchestrrl.client import AsyncClient
from orchestrrl.model import Circuit, Phase, Wiring
from sim_backends.harness import Fabric, start_fabric
from sim_backends.ocs import ApplyResult, SimulatedOcs
from tests.component.test_controller import circuits, table

pytestmark = pytest.mark.component


def orlctl(fabric: Fabric, *args: str) -> Callable[[], int]:
    return lambda: cli.main(["--controller", fabric.address, *args])


def stdout_json(out: str) -> dict[str, object]:
    data: dict[str, object] = json.loads(out[out.index("{\n") :])
    return data


# -- request ids ------------------------------------------------------------------------


async def test_the_replay_sequence_of_issue_14(
    fabric: Fabric, capsys: pytest.CaptureFixture[str]
) -> None:
    """phase set training; phase set training --request-id X2; phase set generation;
    phase set training --request-id X2; phase set weight-sync --request-id X2: the
    second and fourth answer the same recorded "nothing to change" at epoch 1 (no new
    epoch), the fifth is refused naming the first request's phase and epoch."""

    async def phase_set(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = await asyncio.to_thread(orlctl(fabric, "--json", "phase", "set", *args))
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = await phase_set("training")
    assert code == 0 and stdout_json(out)["epoch"] == 1
    code, out, _ = await phase_set("training", "--request-id", "X2")
    first = stdout_json(out)
    assert code == 0 and (first["epoch"], first["changed"]) == (1, False)
    assert "nothing to change" in str(first["message"])
    code, out, _ = await phase_set("generation")
    assert code == 0 and stdout_json(out)["epoch"] == 2
    code, out, _ = await phase_set("training", "--request-id", "X2")
    again = stdout_json(out)
    assert code == 0 and (again["epoch"], again["phase"], again["changed"]) == (
        1, "training", False
    )  # fmt: skip
    assert "already applied" in str(again["message"]) and "nothing to change" in str(
        again["message"]
    )
    assert again["circuits"] == first["circuits"]
    assert fabric.controller.current.epoch == 2 and table(fabric) == set()  # no new epoch
    code, out, err = await phase_set("weight-sync", "--request-id", "X2")
    assert code == 1
    assert "request_id='X2' was already used for phase training (answered at epoch 1)" in err
    assert "FailedPrecondition" in out and "already used for phase training" in out
    assert fabric.controller.current.epoch == 2 and table(fabric) == set()


async def test_request_outcomes_survive_a_restart(fabric: Fabric, client: AsyncClient) -> None:
    first = await client.set_phase("weight-sync", request_id="sync-1")
    await client.set_phase("training")
    nothing = await client.set_phase("training", request_id="noop-1")
    assert nothing.epoch == first.epoch + 1 and not nothing.changed
    await fabric.restart_controller()
    async with AsyncClient(fabric.address, timeout_s=10) as c:
        replay = await c.set_phase("weight-sync", request_id="sync-1")
        assert (replay.epoch, replay.phase, replay.changed) == (first.epoch, "weight-sync", False)
        assert circuits(replay) == circuits(first)
        assert (await c.set_phase("training", request_id="noop-1")).epoch == nothing.epoch
        await c.set_phase("generation")
        # after the restart still: the recorded outcome, never a new epoch
        assert (await c.set_phase("training", request_id="noop-1")).epoch == nothing.epoch
        assert (await c.get_phase()).phase == "generation"
        with pytest.raises(errors.FailedPrecondition, match="already used for phase weight-sync"):
            await c.set_phase("training", request_id="sync-1")


async def test_a_gated_outcome_is_replayed_not_retried(fabric: Fabric, client: AsyncClient) -> None:
    first = await client.set_phase("training")
    gated = await client.set_phase("weight-sync", request_id="g", idle_window_s=0.004)
    assert gated.gated and gated.epoch == first.epoch
    retry = await client.set_phase("weight-sync", request_id="g", idle_window_s=0.5)
    assert retry.gated and not retry.changed and retry.epoch == first.epoch
    assert table(fabric) == circuits(first)


async def test_a_failed_attempt_is_not_recorded(fabric: Fabric, client: AsyncClient) -> None:
    fabric.ocs["ocs0"].fail_next_apply("laser bank 3 offline")
    with pytest.raises(errors.FailedPrecondition, match="laser bank 3 offline"):
        await client.set_phase("training", request_id="t1")
    assert await fabric.controller.store.outcome("t1") is None
    retry = await client.set_phase("training", request_id="t1")  # a fresh attempt
    assert retry.changed and retry.epoch == 1 and table(fabric) == circuits(retry)
    # the same id is free for nothing else now
    with pytest.raises(errors.FailedPrecondition, match="already used for phase training"):
        await client.set_phase("generation", request_id="t1")


# -- degraded phases ----------------------------------------------------------------------


async def test_a_phase_short_of_circuits_says_degraded(
    fabric: Fabric, client: AsyncClient, capsys: pytest.CaptureFixture[str]
) -> None:
    fabric.ocs["ocs0"].set_port_health(1, up=False)  # a train0 uplink
    r = await client.set_phase("training")
    assert r.changed and r.degraded and len(r.circuits) == 7
    assert [(m.pod_a, m.pod_b, m.circuits) for m in r.missing] == [("train0", "train1", 1)]
    assert "degraded: 1 circuit(s) missing (train0-train1: 1)" in r.message
    assert "OCS port(s) ocs0:1 are down" in r.message
    events = [e async for e in client.watch(recent=5, follow=False)]
    committed = [e for e in events if e.kind == "epoch_committed"][-1]
    assert "degraded: 1 circuit(s) missing (train0-train1: 1)" in committed.message
    # a replay of the degraded phase says so too
    again = await client.set_phase("training")
    assert again.degraded and not again.changed

    fabric.ocs["ocs0"].set_port_health(17, up=False)  # a gen0 uplink: costs weight-sync
    capsys.readouterr()
    code = await asyncio.to_thread(orlctl(fabric, "phase", "set", "weight-sync"))
    out = capsys.readouterr().out
    assert code == 0
    assert "DEGRADED: 2 circuit(s) missing because OCS ports are down" in out
    fabric.ocs["ocs0"].set_port_health(17, up=True)
    code = await asyncio.to_thread(orlctl(fabric, "--json", "phase", "set", "generation"))
    data = stdout_json(capsys.readouterr().out)
    assert code == 0 and data["degraded"] is False and data["missing"] == []


async def test_ports_that_are_not_needed_do_not_degrade(
    fabric: Fabric, client: AsyncClient
) -> None:
    fabric.ocs["ocs0"].set_port_health(17, up=False)  # a gen0 uplink: training needs none
    r = await client.set_phase("training")
    assert not r.degraded and r.missing == [] and len(r.circuits) == 8


async def test_a_degraded_phase_gets_its_circuits_back_when_the_port_comes_up(
    fabric: Fabric, client: AsyncClient
) -> None:
    full = await client.set_phase("training")
    assert len(full.circuits) == 8 and not full.degraded
    sim = fabric.ocs["ocs0"]
    lost = next(c for c in circuits(full) if 1 in (c.a, c.b))
    sim.set_port_health(1, up=False)  # the port under a circuit fails
    msg = await fabric.controller.reconcile_once()
    assert msg is not None and "re-planned around them" in msg and "degraded" in msg
    cur = fabric.controller.current
    assert cur.epoch == full.epoch + 1 and cur.degraded and len(cur.circuits) == 7
    assert lost not in table(fabric)
    # nothing changes while the port stays down
    assert await fabric.controller.reconcile_once() == f"switches match epoch {cur.epoch}"

    sim.set_port_health(1, up=True)
    msg = await fabric.controller.reconcile_once()
    assert msg is not None and "OCS port(s) back up" in msg and "full circuits again" in msg
    restored = fabric.controller.current
    assert restored.epoch == cur.epoch + 1 and not restored.degraded
    assert restored.phase is Phase.TRAINING and len(restored.circuits) == 8
    assert table(fabric) == set(restored.circuits)
    kinds = [e.kind async for e in client.watch(recent=3, follow=False)]
    assert "restored" in kinds
    # and it stays put
    assert await fabric.controller.reconcile_once() == f"switches match epoch {restored.epoch}"


# -- recovery after a crash ---------------------------------------------------------------


class Crash(BaseException):
    """Stands in for kill -9: nothing after the hook runs, the journal stays."""


def crash_at(stage: str) -> tuple[Callable[[str], None], list[bool]]:
    armed = [False]

    def hook(at: str) -> None:
        if armed[0] and at == stage:
            armed[0] = False
            raise Crash(at)

    return hook, armed


def count_changes(sim: SimulatedOcs) -> list[ApplyResult]:
    """Record every batch that moved the optics from now on."""
    changes: list[ApplyResult] = []
    apply = sim.apply

    def recording(*args: object, **kwargs: object) -> ApplyResult:
        result = apply(*args, **kwargs)  # type: ignore[arg-type]
        if result.changed:
            changes.append(result)
        return result

    sim.apply = recording  # type: ignore[method-assign]
    return changes


async def crashed_fabric(wiring: Wiring, state: Path, stage: str) -> Fabric:
    """A fabric at epoch 1 (training) whose change to generation died at ``stage``
    with the journal at ``planned``."""
    hook, armed = crash_at(stage)
    f = await start_fabric(wiring, state, switching_time_s=0.0, fault_hook=hook)
    await f.controller.set_phase(Phase.TRAINING)
    armed[0] = True
    with pytest.raises(Crash):
        await f.controller.set_phase(Phase.GENERATION, request_id="gen-1")
    pending = await f.controller.store.pending()
    assert pending is not None and pending.stage == "planned"
    return f


async def test_recovery_rolls_forward_when_the_switch_holds_the_planned_epoch(
    example_wiring: Wiring, tmp_path: Path
) -> None:
    # the crash falls after the (single) batch reached the switch, before the journal
    # said so: the switch holds exactly the planned epoch
    f = await crashed_fabric(example_wiring, tmp_path / "s.db", "program_ocs")
    try:
        assert table(f) == set()
        changes = count_changes(f.ocs["ocs0"])
        await f.restart_controller()
        cur = f.controller.current
        assert (cur.epoch, cur.phase) == (2, Phase.GENERATION) and table(f) == set()
        assert changes == []  # the optics did not switch back and forth
        assert await f.controller.store.pending() is None
        events = f.controller.events.recent(5)
        assert any(
            e.kind == "recovered" and "already held its circuits" in e.message for e in events
        )
        # the interrupted request's outcome is recorded with the epoch
        replay = await f.controller.set_phase(Phase.GENERATION, request_id="gen-1")
        assert replay.record.epoch == 2 and not replay.changed
    finally:
        await f.stop()


async def test_recovery_rolls_back_when_the_switch_does_not_hold_the_planned_epoch(
    example_wiring: Wiring, tmp_path: Path
) -> None:
    for stage, state in (("planned", "a.db"), ("program_ocs", "b.db")):
        f = await crashed_fabric(example_wiring, tmp_path / state, stage)
        try:
            sim = f.ocs["ocs0"]
            if stage == "program_ocs":  # part of the batch is lost: the switch holds neither
                sim.apply([], [(1, 9)])
            training = f.controller.current.circuits
            await f.restart_controller()
            cur = f.controller.current
            assert (cur.epoch, cur.phase) == (1, Phase.TRAINING), stage
            assert table(f) == set(training)
            assert await f.controller.store.pending() is None
            assert await f.controller.store.outcome("gen-1") is None  # not applied
        finally:
            await f.stop()


async def test_recovery_rolls_back_when_the_held_epoch_fails_verification(
    example_wiring: Wiring, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fabric_controller.switches import StageError, Switches

    f = await crashed_fabric(example_wiring, tmp_path / "s.db", "program_ocs")
    try:
        training = f.controller.current.circuits
        converge = Switches.converge
        failed: list[frozenset[Circuit]] = []

        async def verify_fails_once(
            self: Switches, target: frozenset[Circuit], *args: object, **kw: object
        ) -> object:
            if not failed:  # the ToRs' routes over the held epoch cannot be verified
                failed.append(target)
                raise StageError("verify", "ToR 'tor-gen0' routes differ (missing 1)")
            return await converge(self, target, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(Switches, "converge", verify_fails_once)
        await f.restart_controller()
        assert failed == [frozenset()]  # it tried the held (generation) epoch first
        cur = f.controller.current
        assert (cur.epoch, cur.phase) == (1, Phase.TRAINING) and table(f) == set(training)
        assert await f.controller.store.pending() is None
        assert await f.controller.store.outcome("gen-1") is None
    finally:
        await f.stop()
