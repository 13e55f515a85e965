"""The fabric controller over real gRPC, against simulated OCS servers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fabric_controller.drivers.ocs import GrpcOcsDriver, OcsDriver
from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient, PhaseChange
from orchestrrl.model import Circuit, Wiring
from orchestrrl.v1 import common_pb2, node_agent_pb2
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc
from scheduler.network import PhaseDemand
from sim_backends.harness import Fabric, start_fabric
from tests.helpers import FakeClock

pytestmark = pytest.mark.component


def table(fabric: Fabric) -> set[Circuit]:
    return {Circuit(name, a, b) for name, o in fabric.ocs.items() for a, b in o.cross_connects()}


def circuits(r: PhaseChange) -> set[Circuit]:
    return {Circuit(c.ocs, c.a, c.b) for c in r.circuits}


async def test_set_phase_programs_the_ocs_and_commits_an_epoch(
    fabric: Fabric, client: AsyncClient
) -> None:
    r = await client.set_phase("weight-sync")
    assert (r.epoch, r.phase, r.changed) == (1, "weight-sync", True)
    assert len(r.circuits) == 16 and len(r.added) == 16 and r.removed == []
    assert list(r.stages) == ["observe", "plan", "journal", "program_ocs", "verify", "commit"]
    assert table(fabric) == circuits(r)
    assert {tuple(sorted((c.pod_a, c.pod_b))) for c in r.circuits} == {
        ("gen0", "train0"),
        ("gen0", "train1"),
        ("gen1", "train0"),
        ("gen1", "train1"),
    }
    got = await client.get_phase()
    assert (got.epoch, got.phase) == (1, "weight-sync")
    assert {Circuit(c.ocs, c.a, c.b) for c in got.circuits} == circuits(r)

    r2 = await client.set_phase("training")
    assert (r2.epoch, r2.phase) == (2, "training")
    assert len(r2.removed) == 16 and len(r2.added) == 8
    assert table(fabric) == circuits(r2)

    r3 = await client.set_phase("generation")
    assert r3.epoch == 3 and r3.circuits == [] and table(fabric) == set()


async def test_same_phase_twice_changes_nothing(fabric: Fabric, client: AsyncClient) -> None:
    first = await client.set_phase("training")
    again = await client.set_phase("training")
    assert again.epoch == first.epoch and not again.changed
    assert "already in phase training" in again.message
    assert table(fabric) == circuits(first)


async def test_request_id_replays_the_first_result(client: AsyncClient) -> None:
    first = await client.set_phase("weight-sync", request_id="step-7-sync")
    await client.set_phase("training")
    replay = await client.set_phase("weight-sync", request_id="step-7-sync")
    assert replay.epoch == first.epoch and not replay.changed
    assert (await client.get_phase()).phase == "training"


async def test_plan_phase_changes_nothing(fabric: Fabric, client: AsyncClient) -> None:
    await client.set_phase("training")
    before = table(fabric)
    plan = await client.plan_phase("weight-sync")
    assert len(plan.added) == 16 and len(plan.removed) == 8
    assert table(fabric) == before
    assert (await client.get_phase()).epoch == 1


async def test_unknown_phase_is_invalid_argument(fabric: Fabric) -> None:
    async with grpc.aio.insecure_channel(fabric.address) as ch:
        stub = pb_grpc.FabricControllerStub(ch)
        for phase in (common_pb2.PHASE_UNSPECIFIED, 42):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SetPhase(pb.SetPhaseRequest(phase=phase), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "phase=" in info.value.details()
            assert "generation" in info.value.details()
    assert table(fabric) == set()


async def test_ocs_failure_rolls_back_and_keeps_the_epoch(
    fabric: Fabric, client: AsyncClient
) -> None:
    good = await client.set_phase("training")
    fabric.ocs["ocs0"].fail_next_apply("laser bank 3 offline")
    with pytest.raises(errors.FailedPrecondition) as info:
        await client.set_phase("weight-sync")
    msg = str(info.value)
    assert "epoch 2 (weight-sync) not committed" in msg
    assert "program_ocs" in msg and "ocs0" in msg and "laser bank 3 offline" in msg
    assert "rolled back" in msg and "the fabric is at epoch 1" in msg
    assert table(fabric) == circuits(good)
    assert (await client.get_phase()).epoch == 1
    # and the next attempt succeeds
    assert (await client.set_phase("weight-sync")).epoch == 2


def two_ocs_wiring() -> Wiring:
    """The example wiring with the upper half of every ToR's uplinks moved to a second OCS."""
    text = (
        wiring_mod.default_wiring_path()
        .read_text()
        .replace(
            "[[pod]]",
            '[[ocs]]\nname = "ocs1"\naddress = "127.0.0.1:50062"\nports = 32\n\n[[pod]]',
            1,
        )
    )
    for port in range(1, 33):
        if (port - 1) % 8 >= 4:
            text = text.replace(
                f'ocs = "ocs0", ocs_port = {port} ', f'ocs = "ocs1", ocs_port = {port} '
            )
    return wiring_mod.parse(text)


async def test_multi_ocs_failure_rolls_back_switches_already_changed(tmp_path: Path) -> None:
    f = await start_fabric(two_ocs_wiring(), tmp_path / "s.db", switching_time_s=0.0)
    try:
        async with AsyncClient(f.address, timeout_s=10) as c:
            ws = await c.set_phase("weight-sync")
            assert {x.ocs for x in ws.circuits} == {"ocs0", "ocs1"}
            before = {n: o.cross_connects() for n, o in f.ocs.items()}
            # ocs0 is programmed first and succeeds; ocs1 then fails: ocs0 must be undone
            f.ocs["ocs1"].fail_next_apply("injected")
            with pytest.raises(errors.FailedPrecondition, match="OCS 'ocs1' refused the batch"):
                await c.set_phase("training")
            assert {n: o.cross_connects() for n, o in f.ocs.items()} == before
            assert (await c.get_phase()).epoch == ws.epoch
    finally:
        await f.stop()


async def test_state_survives_a_controller_restart(fabric: Fabric, client: AsyncClient) -> None:
    r = await client.set_phase("weight-sync")
    await fabric.restart_controller()
    async with AsyncClient(fabric.address, timeout_s=10) as c2:
        got = await c2.get_phase()
        assert (got.epoch, got.phase) == (r.epoch, "weight-sync")
        nxt = await c2.set_phase("training")
        assert nxt.epoch == r.epoch + 1


async def test_registration_heartbeat_and_liveness(example_wiring: Wiring, tmp_path: Path) -> None:
    # liveness on a fake clock: the node is up until the test moves the clock past its
    # deadline, however long the calls in between take
    clock = FakeClock(100.0)
    f = await start_fabric(example_wiring, tmp_path / "s.db", heartbeat_interval_s=0.05,
                           deadline_s=0.2, monotonic=clock)  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(f.address) as ch, AsyncClient(f.address) as c:
            stub = pb_grpc.FabricControllerStub(ch)
            events = c.watch()
            pending = asyncio.ensure_future(anext(events))
            while f.controller.events.subscriber_count == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            status = node_agent_pb2.NodeStatus(node="gen0-n0", gpu_backend="sim")
            status.gpus.add(index=0)
            reg = await stub.Register(
                pb.RegisterRequest(node="gen0-n0", agent_address="127.0.0.1:1", status=status),
                timeout=5,
            )
            assert reg.session_id and reg.heartbeat_interval_s == pytest.approx(0.05)
            first = await asyncio.wait_for(pending, 5)
            assert (first.kind, first.node) == ("node_registered", "gen0-n0")
            assert "reports 1 GPUs but the wiring says 8" in first.message

            nodes = {n.node: n for n in await c.nodes()}
            assert nodes["gen0-n0"].health == "up"
            assert nodes["gen0-n0"].agent_address == "127.0.0.1:1"
            assert nodes["train0-n0"].health == "unknown"

            # telemetry counts as liveness and is shown by ListNodes
            sample = node_agent_pb2.TelemetrySample(node="gen0-n0", timestamp=1.0)
            sample.engine.tokens_per_s = 1234.0
            resp = await stub.ReportTelemetry(iter([sample]), timeout=5)
            assert resp.accepted == 1
            nodes = {n.node: n for n in await c.nodes()}
            assert nodes["gen0-n0"].telemetry["tokens_per_s"] == 1234.0

            # no heartbeats past the deadline: the node goes down (an event says so), then
            # comes back
            clock.now += 0.2 + 0.01
            kinds = []
            async with asyncio.timeout(5):
                async for e in events:
                    kinds.append(e.kind)
                    if e.kind == "node_down":
                        break
            assert {n.node: n.health for n in await c.nodes()}["gen0-n0"] == "down"
            await stub.Heartbeat(
                pb.HeartbeatRequest(node="gen0-n0", session_id=reg.session_id), timeout=5
            )
            e = await asyncio.wait_for(anext(events), 5)
            assert (e.kind, e.node) == ("node_up", "gen0-n0")
            await events.aclose()  # type: ignore[attr-defined]
    finally:
        await f.stop()


async def test_agent_call_errors_have_the_right_status(fabric: Fabric) -> None:
    async with grpc.aio.insecure_channel(fabric.address) as ch:
        stub = pb_grpc.FabricControllerStub(ch)
        cases = [
            (stub.Register(pb.RegisterRequest(node="nope", agent_address="127.0.0.1:1")),
             grpc.StatusCode.NOT_FOUND, "node 'nope' is not in the wiring"),
            (stub.Register(pb.RegisterRequest(node="", agent_address="127.0.0.1:1")),
             grpc.StatusCode.INVALID_ARGUMENT, "node=''"),
            (stub.Register(pb.RegisterRequest(node="gen0-n0", agent_address="nohost")),
             grpc.StatusCode.INVALID_ARGUMENT, "agent_address='nohost'"),
            (stub.Heartbeat(pb.HeartbeatRequest(node="gen0-n0", session_id="stale")),
             grpc.StatusCode.FAILED_PRECONDITION, "register again"),
        ]  # fmt: skip
        for call, code, text in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == code
            assert text in info.value.details()


async def test_health_and_reflection_are_served(fabric: Fabric) -> None:
    async with grpc.aio.insecure_channel(fabric.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "orchestrrl.v1.FabricController"):
            r = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING


async def test_topology_reports_wiring_and_circuits(fabric: Fabric, client: AsyncClient) -> None:
    await client.set_phase("training")
    t = await client.topology()
    assert t.cluster == "local-8node" and t.epoch == 1
    assert [p.name for p in t.pods] == ["train0", "train1", "gen0", "gen1"]
    assert len(t.nodes) == 8 and len(t.tors) == 4 and len(t.circuits) == 8
    assert t.ocses[0].port_count == 32


async def test_concurrent_phase_changes_are_serialized(
    example_wiring: Wiring, tmp_path: Path
) -> None:
    f = await start_fabric(example_wiring, tmp_path / "s.db", switching_time_s=0.3,
                           lock_timeout_s=0.1)  # fmt: skip
    try:
        async with AsyncClient(f.address, timeout_s=10) as c:
            first = asyncio.create_task(c.set_phase("training"))
            while not f.controller.epochs.busy:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            with pytest.raises(errors.Aborted) as info:
                await c.set_phase("weight-sync")
            assert "another reconfiguration (epoch 1 (training)) is still in progress" in str(
                info.value
            )
            assert (await first).epoch == 1
            assert (await c.get_phase()).phase == "training"
    finally:
        await f.stop()


async def test_waiting_phase_change_runs_after_the_first(
    fabric: Fabric, client: AsyncClient
) -> None:
    a, b = await asyncio.gather(client.set_phase("training"), client.set_phase("weight-sync"))
    assert sorted([a.epoch, b.epoch]) == [1, 2]
    last = a if a.epoch == 2 else b
    assert table(fabric) == circuits(last)


async def test_slack_gate_keeps_the_topology_when_the_window_is_short(
    fabric: Fabric, client: AsyncClient
) -> None:
    # the harness OCS switches in 1 ms; the wiring says 10 ms, the gate uses the wiring
    first = await client.set_phase("training")
    gated = await client.set_phase("weight-sync", idle_window_s=0.004)
    assert gated.gated and not gated.changed and gated.epoch == first.epoch
    assert "kept the current topology" in gated.message
    # every new circuit reuses a port of a removed one: one (break) step of 10 ms
    assert "OCS switching 10.0 ms + settling 5.0 ms" in gated.message
    assert table(fabric) == circuits(first)
    ok = await client.set_phase("weight-sync", idle_window_s=0.5)
    assert ok.changed and not ok.gated and ok.epoch == first.epoch + 1


async def test_events_recent_and_follow(fabric: Fabric, client: AsyncClient) -> None:
    await client.set_phase("training")
    await client.set_phase("weight-sync")
    recent = [e async for e in client.watch(recent=10, follow=False)]
    kinds = [e.kind for e in recent]
    assert kinds[-2:] == ["epoch_committed", "epoch_committed"]
    assert recent[-1].phase == "weight-sync" and "program_ocs" in recent[-1].stages


async def test_down_pods_are_left_out_of_the_plan(example_wiring: Wiring, tmp_path: Path) -> None:
    f = await start_fabric(example_wiring, tmp_path / "s.db", heartbeat_interval_s=0.05,
                           deadline_s=0.15)  # fmt: skip
    try:
        async with AsyncClient(f.address, timeout_s=10) as c:
            for node in ("gen1-n0", "gen1-n1"):
                f.controller.register(node, f"{node}:1", "sim", 8)
            await asyncio.sleep(0.4)  # no heartbeats: gen1 is down
            assert {n.node: n.health for n in await c.nodes()}["gen1-n0"] == "down"
            r = await c.set_phase("weight-sync")
            pods = {tuple(sorted((x.pod_a, x.pod_b))) for x in r.circuits}
            assert pods == {("gen0", "train0"), ("gen0", "train1")}
            assert len(r.circuits) == 8  # gen0's 8 ports, split over both training pods
    finally:
        await f.stop()


async def test_metrics_count_epochs_and_stages(fabric: Fabric, client: AsyncClient) -> None:
    from prometheus_client import generate_latest

    await client.set_phase("training")
    text = generate_latest(fabric.controller.metrics.registry).decode()
    assert "orl_epochs_total 1.0" in text
    assert 'orl_reconfiguration_stage_seconds_count{stage="program_ocs"} 1.0' in text
    assert "orl_epoch 1.0" in text


async def test_ocs_timeout_is_resolved_by_reading_the_switch_back(
    example_wiring: Wiring, tmp_path: Path
) -> None:
    # the switch applies each batch, then takes 0.4 s of "optics"; the driver gives up
    # after 0.15 s: the outcome is unknown until the controller reads the table back
    f = await start_fabric(example_wiring, tmp_path / "s.db", switching_time_s=0.4,
                           ocs_timeout_s=0.15)  # fmt: skip
    try:
        async with AsyncClient(f.address, timeout_s=10) as c:
            r = await c.set_phase("training")
            assert r.epoch == 1 and table(f) == circuits(r)
    finally:
        await f.stop()


async def test_unreachable_ocs_mid_change_ends_in_a_known_epoch(
    example_wiring: Wiring, tmp_path: Path
) -> None:
    f = await start_fabric(example_wiring, tmp_path / "s.db", switching_time_s=0.0,
                           ocs_timeout_s=1.0)  # fmt: skip
    try:
        async with AsyncClient(f.address, timeout_s=10) as c:
            good = await c.set_phase("training")
            saved = f.controller.ocs["ocs0"]
            # the switch drops off the network: the change stops at observe, untouched
            f.controller.ocs["ocs0"] = GrpcOcsDriver("ocs0", "127.0.0.1:1", timeout_s=1.0)
            with pytest.raises(errors.Unavailable) as info:
                await c.set_phase("weight-sync")
            assert "OCS 'ocs0' at 127.0.0.1:1: ListCrossConnects: UNAVAILABLE" in str(info.value)
            assert table(f) == circuits(good)  # nothing reached the switch
            f.controller.ocs["ocs0"] = saved  # back on the network
            assert await f.controller.reconcile_once() is not None
            assert (await c.get_phase()).epoch == good.epoch
            assert (await c.set_phase("weight-sync")).epoch == good.epoch + 1
    finally:
        await f.stop()


# -- the network planner in the controller ------------------------------------------


def uneven_wiring() -> Wiring:
    """Two training pods of 3 and 1 nodes with 16 OCS ports each, two generation pods
    of 2 nodes with 8 ports each.

    After a sharded optimizer step every training node holds an equal share of the
    model, so train0 sends three times train1's bytes in weight sync."""
    doc: dict[str, object] = {
        "cluster": {"name": "uneven", "controller": "127.0.0.1:50051"},
        "ocs": [{"name": "ocs0", "address": "127.0.0.1:50061", "ports": 48}],
        "pod": [],
        "tor": [],
        "node": [],
    }
    pods, tors, nodes = [], [], []
    port = 1
    for i, (pod, role, count, uplinks) in enumerate(
        [("train0", "train", 3, 16), ("train1", "train", 1, 16), ("gen0", "gen", 2, 8),
         ("gen1", "gen", 2, 8)]
    ):  # fmt: skip
        pods.append({"name": pod})
        ups = [{"port": f"up{k}", "ocs": "ocs0", "ocs_port": port + k} for k in range(uplinks)]
        port += uplinks
        tors.append({"name": f"tor-{pod}", "pod": pod, "uplinks": ups})
        for n in range(count):
            nodes.append(
                {"name": f"{pod}-n{n}", "pod": pod, "role": role, "gpus": 8,
                 "agent": f"127.0.0.1:{52000 + 10 * i + n}"}
            )  # fmt: skip
    doc.update(pod=pods, tor=tors, node=nodes)
    return wiring_mod.validate(doc)


def pair_counts(r: PhaseChange) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for c in r.circuits:
        key = (min(c.pod_a, c.pod_b), max(c.pod_a, c.pod_b))
        out[key] = out.get(key, 0) + 1
    return out


async def set_phase_explained(
    address: str, phase: common_pb2.Phase.ValueType
) -> pb.SetPhaseResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        r: pb.SetPhaseResponse = await pb_grpc.FabricControllerStub(ch).SetPhase(
            pb.SetPhaseRequest(phase=phase), timeout=10
        )
        return r


async def test_weight_sync_circuits_follow_the_demand_not_the_template(tmp_path: Path) -> None:
    f = await start_fabric(uneven_wiring(), tmp_path / "s.db", switching_time_s=0.0)
    try:
        async with AsyncClient(f.address, timeout_s=10) as c:
            r = await c.set_phase("weight-sync")
            counts = pair_counts(r)
            # bottleneck first: train0 carries 3/4 of the model, so it gets most of each
            # generation pod's 8 ports (the template would split them 4 and 4)
            assert counts[("gen0", "train0")] == counts[("gen1", "train0")] == 6
            assert counts[("gen0", "train1")] == counts[("gen1", "train1")] == 2
            assert table(f) == circuits(r)
            plan = await c.plan_phase("training")
            assert len(plan.added) == 16 and len(plan.removed) == 16  # train0 <-> train1
        async with grpc.aio.insecure_channel(f.address) as ch:
            stub = pb_grpc.FabricControllerStub(ch)
            preview = await stub.PlanPhase(
                pb.PlanPhaseRequest(phase=common_pb2.PHASE_TRAINING), timeout=10
            )
            assert preview.explanation.startswith("network planner (training)")
            assert "train0 <-> train1" in preview.explanation
            again = await stub.SetPhase(
                pb.SetPhaseRequest(phase=common_pb2.PHASE_WEIGHT_SYNC), timeout=10
            )
            assert not again.changed and "network planner (weight-sync)" in again.explanation
            assert "gen0 <-> train0: 22.16 GB over 6 circuit(s)" in again.explanation
            # replies are assembled from per-circuit encodings: the same as built directly
            got = await stub.GetPhase(pb.GetPhaseRequest(), timeout=10)
            assert list(again.circuits) == list(got.circuits) and len(got.circuits) == 16
    finally:
        await f.stop()


async def test_phase_template_is_the_fallback_without_demand(tmp_path: Path) -> None:
    f = await start_fabric(uneven_wiring(), tmp_path / "s.db", switching_time_s=0.0,
                           demand=PhaseDemand(model_bytes=0))  # fmt: skip
    try:
        r = await set_phase_explained(f.address, common_pb2.PHASE_WEIGHT_SYNC)
        assert r.changed and r.explanation.startswith("phase template weight-sync")
        assert "no demand information (model_bytes is 0)" in r.explanation
        counts: dict[tuple[str, str], int] = {}
        for c in r.circuits:
            key = (min(c.pod_a, c.pod_b), max(c.pod_a, c.pod_b))
            counts[key] = counts.get(key, 0) + 1
        assert set(counts.values()) == {4}  # the template splits every pod's ports evenly
        # training still has its bytes: the network planner
        t = await set_phase_explained(f.address, common_pb2.PHASE_TRAINING)
        assert t.explanation.startswith("network planner (training)")
    finally:
        await f.stop()


async def test_plans_follow_pods_going_down_between_changes(
    example_wiring: Wiring, tmp_path: Path
) -> None:
    # the same transition twice, with a pod gone in between: the memoized plan of the
    # first must not be reused for the second
    f = await start_fabric(example_wiring, tmp_path / "s.db", heartbeat_interval_s=0.05,
                           deadline_s=0.15)  # fmt: skip
    try:
        async with AsyncClient(f.address, timeout_s=10) as c:
            first = await c.set_phase("weight-sync")
            assert len(first.circuits) == 16
            await c.set_phase("training")
            for node in ("gen1-n0", "gen1-n1"):
                f.controller.register(node, f"{node}:1", "sim", 8)
            await asyncio.sleep(0.4)  # no heartbeats: gen1 is down
            second = await c.set_phase("weight-sync")
            pods = {tuple(sorted((x.pod_a, x.pod_b))) for x in second.circuits}
            assert pods == {("gen0", "train0"), ("gen0", "train1")}
    finally:
        await f.stop()


async def test_a_switch_that_acknowledges_without_applying_fails_verification(
    fabric: Fabric, client: AsyncClient
) -> None:
    good = await client.set_phase("training")
    fabric.ocs["ocs0"].ignore_next_apply()  # answers "done" with its unchanged table
    with pytest.raises(errors.FailedPrecondition) as info:
        await client.set_phase("weight-sync")
    msg = str(info.value)
    assert "epoch 2 (weight-sync) not committed: stage verify" in msg
    assert "is missing" in msg and "the fabric is at epoch 1" in msg
    assert table(fabric) == circuits(good)
    assert (await client.get_phase()).epoch == 1
    assert (await client.set_phase("weight-sync")).epoch == 2


async def test_batches_of_a_step_go_to_every_switch_at_once(tmp_path: Path) -> None:
    f = await start_fabric(two_ocs_wiring(), tmp_path / "s.db", switching_time_s=0.05)
    active: list[str] = []
    overlapped: set[frozenset[str]] = set()

    class Watched:
        """An OCS driver that records which batches are in flight together."""

        def __init__(self, inner: OcsDriver) -> None:
            self.inner = inner
            self.name = inner.name

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        async def apply(self, *args: object, **kwargs: object) -> frozenset[tuple[int, int]]:
            active.append(self.name)
            overlapped.add(frozenset(active))
            try:
                return await self.inner.apply(*args, **kwargs)  # type: ignore[arg-type]
            finally:
                active.remove(self.name)

    try:
        for name, driver in list(f.controller.ocs.items()):
            f.controller.ocs[name] = Watched(driver)  # type: ignore[assignment]
        async with AsyncClient(f.address, timeout_s=10) as c:
            r = await c.set_phase("weight-sync")
            assert {x.ocs for x in r.added} == {"ocs0", "ocs1"}
        assert frozenset({"ocs0", "ocs1"}) in overlapped  # one step, both switches at once
    finally:
        await f.stop()


def test_demand_flags_parse_bytes_and_reject_nonsense() -> None:
    from fabric_controller.main import build_parser

    args = build_parser().parse_args(["--model-bytes", "145G", "--training-bytes", "2.5e9"])
    assert (args.model_bytes, args.training_bytes) == (145e9, 2.5e9)
    defaults = build_parser().parse_args([])
    assert defaults.model_bytes == PhaseDemand().model_bytes > 29e9
    assert build_parser().parse_args(["--model-bytes", "0"]).model_bytes == 0.0  # unknown
    for bad in ("-1", "lots", "inf", "1Q"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([f"--model-bytes={bad}"])


async def test_orlctl_plan_phase_prints_why(
    fabric: Fabric, client: AsyncClient, capsys: pytest.CaptureFixture[str]
) -> None:
    from fabric_controller import cli

    await client.set_phase("training")
    capsys.readouterr()  # (the in-process controller logs to stdout too)
    args = ["--controller", fabric.address, "plan", "phase", "weight-sync"]
    assert await asyncio.to_thread(cli.main, args) == 0
    out = capsys.readouterr().out
    assert "phase weight-sync would add 16 and remove 8 circuit(s)\n" in out
    assert "  network planner (weight-sync): bottleneck-first circuits" in out
    assert "gen0 <-> train0: 14.77 GB over 4 circuit(s)" in out
    assert await asyncio.to_thread(cli.main, ["--json", *args]) == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{\n") :])
    assert data["explanation"].startswith("network planner (weight-sync)")
    assert len(data["added"]) == 16 and len(data["removed"]) == 8
    assert table(fabric) == {Circuit(x.ocs, x.a, x.b) for x in (await client.get_phase()).circuits}
