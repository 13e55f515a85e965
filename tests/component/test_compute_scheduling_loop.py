"""The compute-scheduling loop end to end in one process: a real controller (gRPC, with
simulated OCS) and two real node agents with simulated engines, registered and streaming
telemetry over their uplinks. A long tail on one node makes the loop reshard and move
requests; a destination that refuses ends with the requests back on the source."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from structlog.testing import capture_logs

from fabric_controller import scheduling
from fabric_controller.drivers.agents import AgentClients
from fabric_controller.scheduler_loop import ComputeScheduler
from node_agent.commands import CommandLog
from node_agent.engine import EngineState
from node_agent.nics import SysfsNics
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from orchestrrl import grpcutil
from orchestrrl.client import AsyncClient
from orchestrrl.model import Mode, Wiring
from orchestrrl.v1 import node_agent_pb2 as pb
from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc
from scheduler.compute_state import MoveMethod
from scheduler.replan import ReplanSchedule
from sim_backends.engine import SimEngineConfig, SimulatedEngine
from sim_backends.gpus import SimulatedGpus
from sim_backends.harness import Fabric
from tests import helpers
from tests.helpers import Agent

if TYPE_CHECKING:
    pass

pytestmark = pytest.mark.component

GEN = ("gen0-n0", "gen0-n1")
# no arrivals: the test places the step's requests itself (through ImportRequests)
QUIET = SimEngineConfig(arrival_rate_per_gpu=0.0)


@dataclass
class Cluster:
    fabric: Fabric
    scheduler: ComputeScheduler
    controller_address: str  # serves GetSchedule from ``scheduler``
    agents: dict[str, Agent]


async def start_agent(
    node: str, controller: str, tmp: Path, clock: Callable[[], float] = time.monotonic
) -> Agent:
    engine = SimulatedEngine(
        8, (2, 2, 2, 2), seed=1, config=QUIET, request_prefix=node, clock=clock
    )
    return await helpers.start_agent(node, engine, 8, controller, tmp)


@pytest.fixture
async def cluster(
    example_wiring: Wiring, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Cluster]:
    """``request.param`` (indirect parametrisation), if any: node -> its engine's clock."""
    clocks: dict[str, Callable[[], float]] = getattr(request, "param", {})
    config = scheduling.SchedulingConfig(interval_s=0.1, replan=ReplanSchedule(0.2), hold_s=10.0)
    async with helpers.compute_loop(
        example_wiring, tmp_path / "state.db", config, deadline_s=2.0, agent_timeout_s=5.0
    ) as loop:
        agents: dict[str, Agent] = {}
        try:
            for node in GEN:
                agents[node] = await start_agent(
                    node, loop.address, tmp_path, clocks.get(node, time.monotonic)
                )
            yield Cluster(loop.fabric, loop.scheduler, loop.address, agents)
        finally:
            for a in agents.values():
                await a.stop()


async def until(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 - polls state that other tasks change
            await asyncio.sleep(0.02)
    assert check(), what


async def decided(c: Cluster) -> scheduling.Decision:
    """The first decision of a round that does not wait for telemetry newer than the
    last action."""
    async with asyncio.timeout(30.0):
        while True:
            d = await c.scheduler.round()
            if d.mode != "wait":
                return d
            await asyncio.sleep(0.05)


def long_request(rid: str, instance: int, generated: int = 6000) -> pb.RequestState:
    return pb.RequestState(
        request_id=rid,
        prompt_tokens=512,
        generated_tokens=generated,
        max_tokens=16384,
        source_instance=instance,
        engine_state=json.dumps({"output_tokens": 15000}).encode(),
    )


async def seed(agent: Agent, rid: str, instance: int) -> None:
    """A long request running on ``instance`` of the agent's node (imported there)."""
    reply = await agent.stub.ImportRequests(
        pb.ImportRequestsRequest(
            command_id=f"seed-{rid}",
            instance=instance,
            method=pb.MIGRATION_METHOD_KV,
            requests=[long_request(rid, instance)],
        ),
        timeout=5.0,
    )
    assert list(reply.admitted) == [rid]


async def seed_long_tail(agent: Agent) -> list[str]:
    """Four long requests, one on each TP2 instance of the node: a step's long tail."""
    ids = [f"tail-{k}" for k in range(4)]
    for k, rid in enumerate(ids):
        await seed(agent, rid, k)
    return ids


async def seed_one_on_each_node(c: Cluster) -> None:
    """One long request on each node (nothing queued), until the controller sees them."""
    await seed(c.agents["gen0-n0"], "tail-a", 0)
    await seed(c.agents["gen0-n1"], "tail-b", 1)
    await until("both agents report telemetry", lambda: registered(c))
    await until(
        "the controller sees one request on each node",
        lambda: all(
            len(r.telemetry.engine.requests) == 1
            for r in c.fabric.controller.registry.records()
            if r.telemetry is not None
        ),
    )


def on_node(agent: Agent) -> set[str]:
    return {r.request_id for r in agent.engine.progress().requests}


def registered(c: Cluster) -> bool:
    recs = {r.name: r for r in c.fabric.controller.registry.records()}
    return all(recs[n].telemetry is not None for n in GEN)


async def test_long_tail_makes_the_loop_reshard_and_move_requests(cluster: Cluster) -> None:
    c = cluster
    ids = await seed_long_tail(c.agents["gen0-n0"])
    await until("both agents report telemetry", lambda: registered(c))
    await until(
        "the controller sees the four requests",
        lambda: all(
            len(r.telemetry.engine.requests) == 4
            for r in c.fabric.controller.registry.records()
            if r.name == "gen0-n0" and r.telemetry is not None
        ),
    )
    decision = await c.scheduler.round()
    assert decision.mode == "replan" and decision.plan is not None
    assert decision.plan.reshards, decision.plan.explain()

    async with AsyncClient(c.controller_address, timeout_s=5.0) as client:
        s = await client.schedule()
    assert s.enabled and s.acted and s.mode == "replan"
    assert s.requests == 4
    planned = {r["node"]: r["after"] for r in s.reshards}
    assert planned.get("gen0-n0") == [8], s.explanation
    layouts = {x["node"]: (x["before"], x["after"]) for x in s.layouts}
    assert layouts["gen0-n0"] == ([2, 2, 2, 2], [8])
    assert "reshard gen0-n0: TP2+TP2+TP2+TP2 -> TP8" in s.explanation
    assert s.prediction["gain_s"] > 0
    kinds = [(a["kind"], a["ok"]) for a in s.actions]
    assert ("reshard", True) in kinds, s.actions

    # the agents did it: layouts changed as planned, moved requests run on the target
    for node, after in planned.items():
        status = await c.agents[node].stub.GetStatus(pb.GetStatusRequest(), timeout=5.0)
        assert tuple(status.tp_layout) == tuple(after)
    moved = {
        m["request_id"]: m["target_node"]
        for m in s.migrations
        if m["source_node"] != m["target_node"]
    }
    if moved:
        assert ("migrate", True) in kinds, s.actions
    for rid in ids:
        target = moved.get(rid, "gen0-n0")
        assert rid in on_node(c.agents[target]), (rid, target, s.actions)
    assert on_node(c.agents["gen0-n0"]) | on_node(c.agents["gen0-n1"]) == set(ids)

    # the next rounds wait for telemetry newer than the actions, then change no layout
    again = await decided(c)
    assert again.plan is not None
    assert not again.plan.reshards, again.plan.explain()


class ManualClock:
    """An engine's clock that moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


SLOW = ManualClock()  # gen0-n0's engine clock in the test below


@pytest.mark.parametrize("cluster", [{"gen0-n0": SLOW}], indirect=True)
async def test_a_node_whose_reshard_measured_long_is_not_resharded_for_a_small_gain(
    cluster: Cluster,
) -> None:
    """vLLM reshards by restarting its instances (54-91 s measured) where the perf model
    says about 2 s. Once the loop has measured a long pause on a node (from the stage
    timings its agent reports), a reshard there whose gain is below it is left out, the
    layout stays, and GetSchedule and the log say why. (The same long tail without the
    measurement is resharded: test_long_tail_makes_the_loop_reshard_and_move_requests.)"""
    c = cluster
    n0 = c.agents["gen0-n0"]
    await until("both agents report telemetry", lambda: registered(c))
    # the loop's own reshard command, as after a plan: the first measures no pause on the
    # engine's clock; the second is held in its relayout stage while the clock moves 600 s
    first = await c.scheduler.reshard(
        scheduling.ReshardCommand("probe-1", "gen0-n0", (4, 4), (2, 2, 2, 2)), n0.server.address
    )
    assert first.ok, first.message
    assert dict(c.scheduler.view().reshard_pauses) == {"gen0-n0": 0.0}
    hold = asyncio.Event()
    n0.engine.relayout_hold = hold
    second = asyncio.create_task(
        c.scheduler.reshard(
            scheduling.ReshardCommand("probe-2", "gen0-n0", (2, 2, 2, 2), (4, 4)),
            n0.server.address,
        )
    )
    await until(
        "the reshard is in its relayout stage", lambda: n0.engine.state is EngineState.RESHARDING
    )
    SLOW.now += 600.0
    hold.set()
    done = await second
    assert done.ok and "relayout 600.000 s" in done.message, done.message
    assert dict(c.scheduler.view().reshard_pauses) == {"gen0-n0": 600.0}

    ids = await seed_long_tail(n0)
    await until(
        "the controller sees the four requests on TP2 instances",
        lambda: any(
            r.name == "gen0-n0"
            and r.telemetry is not None
            and len(r.telemetry.engine.requests) == 4
            and list(r.telemetry.tp_layout) == [2, 2, 2, 2]
            for r in c.fabric.controller.registry.records()
        ),
    )
    with capture_logs() as logs:
        decision = await c.scheduler.round()
    assert decision.mode == "replan" and decision.plan is not None
    plan = decision.plan
    assert not plan.reshards, plan.explain()
    hold_for_cost = plan.cost_hold
    assert hold_for_cost is not None, plan.explain()
    assert hold_for_cost.nodes == ("gen0-n0",)
    assert hold_for_cost.pause_s == 600.0
    assert hold_for_cost.model_pause_s < hold_for_cost.gain_s < 600.0  # the model would switch
    skipped = [e for e in logs if e["event"] == "compute_reshard_skipped_for_cost"]
    assert len(skipped) == 1 and skipped[0]["nodes"] == ["gen0-n0"], logs
    assert skipped[0]["measured_pause_s"] == 600.0
    status = await n0.stub.GetStatus(pb.GetStatusRequest(), timeout=5.0)
    assert tuple(status.tp_layout) == (2, 2, 2, 2)
    assert set(ids) <= on_node(n0) | on_node(c.agents["gen0-n1"])

    async with AsyncClient(c.controller_address, timeout_s=5.0) as client:
        s = await client.schedule()
    assert s.reshard_pause_s == {"gen0-n0": 600.0}
    assert not s.reshards
    assert "measured reshard pause 600.00 s on gen0-n0" in s.reason, s.reason
    assert "measured reshard pauses: gen0-n0 600.00 s" in s.explanation, s.explanation


async def test_refused_migration_returns_the_requests_to_the_source(cluster: Cluster) -> None:
    c = cluster
    ids = await seed_long_tail(c.agents["gen0-n0"])
    await until("both agents report telemetry", lambda: registered(c))
    # the destination stops admitting: its ImportRequests refuses with FAILED_PRECONDITION
    await c.agents["gen0-n1"].stub.Drain(pb.DrainRequest(command_id="drain"), timeout=5.0)
    cmd = scheduling.MigrateCommand(
        "t-migrate-0", "gen0-n0", "gen0-n1", 0, False, (ids[0], ids[1]),
        MoveMethod.KV_NETWORK, 0.03,
    )  # fmt: skip
    addresses = {n: a.server.address for n, a in c.agents.items()}
    record = await c.scheduler.migrate(cmd, addresses)
    assert not record.ok
    assert "gen0-n1 refused 2 request(s)" in record.message
    assert "not admitting" in record.message
    assert "2 restored on gen0-n0" in record.message
    assert on_node(c.agents["gen0-n0"]) == set(ids)
    assert on_node(c.agents["gen0-n1"]) == set()
    assert c.agents["gen0-n0"].servicer._exports.held() == {}
    # back on their instances, still decoding
    where = {r.request_id: r.instance for r in c.agents["gen0-n0"].engine.progress().requests}
    assert where[ids[0]] == 0 and where[ids[1]] == 1

    async with AsyncClient(c.controller_address, timeout_s=5.0) as client:
        s = await client.schedule()
    assert s.actions[-1]["kind"] == "migrate" and not s.actions[-1]["ok"]
    assert s.actions[-1]["requests"] == ids[:2]
    assert s.actions[-1]["method"] == "kv"  # what was asked (it was refused)

    # a retried export under the same command id replays, it does not export again
    src = c.agents["gen0-n0"].stub
    # (held for long enough that it cannot run out before the test resolves it)
    first = await src.ExportRequests(
        pb.ExportRequestsRequest(command_id="x1", request_ids=[ids[2]], hold_s=60.0), timeout=5.0
    )
    again = await src.ExportRequests(
        pb.ExportRequestsRequest(command_id="x1", request_ids=[ids[2]], hold_s=60.0), timeout=5.0
    )
    assert first == again and [r.request_id for r in first.requests] == [ids[2]]
    assert ids[2] not in on_node(c.agents["gen0-n0"])
    # the destination takes it (it admits again): the source releases it
    await c.agents["gen0-n1"].stub.Resume(pb.ResumeRequest(command_id="resume"), timeout=5.0)
    await c.agents["gen0-n1"].stub.ImportRequests(
        pb.ImportRequestsRequest(
            command_id="i1", instance=2, method=pb.MIGRATION_METHOD_RECOMPUTE,
            requests=first.requests,
        ),
        timeout=5.0,
    )  # fmt: skip
    done = await src.ResolveExport(
        pb.ResolveExportRequest(command_id="r1", export_command_id="x1", restore=False),
        timeout=5.0,
    )
    assert list(done.released) == [ids[2]]
    assert ids[2] in on_node(c.agents["gen0-n1"]) and ids[2] not in on_node(c.agents["gen0-n0"])


async def test_an_unresolved_export_is_restored_when_its_hold_expires(cluster: Cluster) -> None:
    ids = await seed_long_tail(cluster.agents["gen0-n0"])
    src = cluster.agents["gen0-n0"].stub
    with capture_logs() as logs:
        r = await src.ExportRequests(
            pb.ExportRequestsRequest(command_id="x", request_ids=[ids[0], "nope"], hold_s=0.2),
            timeout=5.0,
        )
        # off the node while held, unless the 0.2 s ran out before the answer came back
        expired = any(e["event"] == "export_expired_restored" for e in logs)
        assert expired or ids[0] not in on_node(cluster.agents["gen0-n0"])
        await until("restored by the hold", lambda: ids[0] in on_node(cluster.agents["gen0-n0"]))
    assert [x.request_id for x in r.requests] == [ids[0]] and list(r.missing) == ["nope"]
    [restored] = [e for e in logs if e["event"] == "export_expired_restored"]
    assert restored["export"] == "x" and restored["requests"] == [ids[0]]
    late = await src.ResolveExport(
        pb.ResolveExportRequest(command_id="late", export_command_id="x", restore=False),
        timeout=5.0,
    )
    assert list(late.restored) == [ids[0]] and not late.released
    assert "not resolved within 0.2 s" in late.message


async def test_with_mutual_tls_only_the_controller_may_migrate(tmp_path: Path) -> None:
    from orchestrrl import errors
    from orchestrrl.devcerts import make_dev_pki
    from orchestrrl.tls import Authorizer, TlsConfig

    pki = make_dev_pki(tmp_path / "pki", ["orl-fabric-controller", "gen0-n0", "alice"])

    def tls(who: str) -> TlsConfig:
        return TlsConfig(pki[who].cert, pki[who].key, pki[who].ca)

    engine = SimulatedEngine(8, (2, 2, 2, 2), seed=1, config=QUIET, request_prefix="n0")
    collector = Collector("gen0-n0", SimulatedGpus(8, seed=1), SysfsNics([], root=tmp_path), engine)
    await collector.open()
    servicer = NodeAgentService(
        collector, engine, CommandLog(), 0.05, auth=Authorizer(tls("gen0-n0")),
        controllers=frozenset({"orl-fabric-controller"}),
    )  # fmt: skip
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: pb_grpc.add_NodeAgentServicer_to_server(servicer, s),
        [SERVICE_NAME],
        tls=tls("gen0-n0"),
    )
    try:
        for who, allowed in (("orl-fabric-controller", True), ("alice", False)):
            clients = AgentClients(tls(who), timeout_s=5.0)
            agent = clients.get("gen0-n0", server.address)
            try:
                if allowed:
                    r = await agent.import_requests("i", "", 0, True, [long_request("a", 0)])
                    assert list(r.admitted) == ["a"]
                    out = await agent.export_requests("x", ["a"], 5.0)
                    assert [s.request_id for s in out.requests] == ["a"]
                    back = await agent.resolve_export("r", "x", restore=True)
                    assert back.restored == ("a",)
                else:
                    with pytest.raises(errors.PermissionDenied, match="orl-fabric-controller"):
                        await agent.export_requests("x2", ["a"], 5.0)
                    with pytest.raises(errors.PermissionDenied):
                        await agent.import_requests("i2", "", 0, True, [long_request("b", 0)])
                    with pytest.raises(errors.PermissionDenied):
                        await agent.resolve_export("r2", "x", restore=False)
            finally:
                await clients.close()
        assert {r.request_id for r in engine.progress().requests} == {"a"}
    finally:
        await server.stop(0.1)
        await servicer.close()


async def test_get_schedule_says_when_the_loop_is_off(cluster: Cluster) -> None:
    # the harness's own server has no compute scheduler
    async with AsyncClient(cluster.fabric.address, timeout_s=5.0) as client:
        s = await client.schedule()
    assert not s.enabled and not s.acted and s.actions == []
    assert "compute scheduling is off" in s.explanation
    # the loop's server before any round
    async with AsyncClient(cluster.controller_address, timeout_s=5.0) as client:
        s = await client.schedule()
    assert s.enabled and s.interval_s == 0.1 and s.planned_at == 0.0
    assert "no plan yet" in s.explanation


async def test_the_plan_reports_the_sample_groups_of_the_step(cluster: Cluster) -> None:
    """Requests tagged with their sample group (GRPO: the prompt) carry it through the
    agent's telemetry to the controller's forecast; GetSchedule says what it used."""
    c = cluster
    agent = c.agents["gen0-n0"]
    for k in range(4):
        request = long_request(f"grouped-{k}", k)
        request.group = f"prompt-{k % 2}"
        await agent.stub.ImportRequests(
            pb.ImportRequestsRequest(
                command_id=f"grouped-{k}",
                instance=k,
                method=pb.MIGRATION_METHOD_KV,
                requests=[request],
            ),
            timeout=5.0,
        )
    await until("both agents report telemetry", lambda: registered(c))
    await until(
        "the controller sees the groups",
        lambda: any(
            {r.group for r in rec.telemetry.engine.requests} == {"prompt-0", "prompt-1"}
            for rec in c.fabric.controller.registry.records()
            if rec.telemetry is not None
        ),
    )
    decision = await c.scheduler.round()
    assert (decision.groups, decision.groups_with_prior) == (2, 0)
    async with AsyncClient(c.controller_address, timeout_s=5.0) as client:
        s = await client.schedule()
    assert (s.groups, s.groups_with_prior) == (2, 0)
    assert "length signal: 2 sample groups, 0 of them met in an earlier step" in s.explanation


async def test_an_operator_pauses_the_loop_and_resuming_replans_at_once(
    cluster: Cluster,
) -> None:
    c = cluster
    async with AsyncClient(c.controller_address, timeout_s=5.0) as client:
        s = await client.pause_schedule(True)
        assert s.paused and "paused by an operator" in s.explanation
        await seed_long_tail(c.agents["gen0-n0"])
        await until("both agents report telemetry", lambda: registered(c))
        await until(
            "the controller sees the four requests",
            lambda: any(
                len(r.telemetry.engine.requests) == 4
                for r in c.fabric.controller.registry.records()
                if r.name == "gen0-n0" and r.telemetry is not None
            ),
        )
        for _ in range(3):  # paused: the rounds observe, and decide and do nothing
            decision = await c.scheduler.round()
            assert decision.mode == "paused" and decision.plan is None
        s = await client.schedule()
        assert s.paused and not s.actions and s.step == c.scheduler._tracker.step
        status = await c.agents["gen0-n0"].stub.GetStatus(pb.GetStatusRequest(), timeout=5.0)
        assert tuple(status.tp_layout) == (2, 2, 2, 2)

        s = await client.pause_schedule(False)
        assert not s.paused and s.mode == "resumed"
        assert s.explanation.endswith("resumed by an operator: the next round re-plans")
        decision = await c.scheduler.round()  # the first round after resuming re-plans
        assert decision.mode == "replan" and decision.plan is not None
        assert decision.plan.reshards, decision.plan.explain()
        s = await client.schedule()
        assert ("reshard", True) in [(a["kind"], a["ok"]) for a in s.actions], s.actions


async def test_in_async_mode_the_tail_is_repacked_onto_one_node_which_reshards_wide(
    cluster: Cluster,
) -> None:
    """One long request left on each node, nothing queued: in async mode the loop moves
    one node's request onto the other, which reshards to one TP8 instance (a long tail
    ends sooner there), and the emptied node is free for fresh prompts. In phased mode the
    same state is the step's re-plan's, not a repack."""
    c = cluster
    await seed_one_on_each_node(c)
    await c.fabric.controller.set_mode(Mode.ASYNC, "to-async")
    decision = await c.scheduler.round()
    assert decision.mode == "repack" and decision.plan is not None, decision.why
    plan = decision.plan
    assert [(r.node, r.after) for r in plan.reshards] == [("gen0-n1", (8,))], plan.explain()
    assert [(m.request, m.target) for m in plan.migrations] == [("tail-a", "gen0-n1/tp8-g0")]
    assert "frees gen0-n0 for fresh prompts" in plan.reason

    assert on_node(c.agents["gen0-n0"]) == set()
    assert on_node(c.agents["gen0-n1"]) == {"tail-a", "tail-b"}
    status = await c.agents["gen0-n1"].stub.GetStatus(pb.GetStatusRequest(), timeout=5.0)
    assert tuple(status.tp_layout) == (8,)
    async with AsyncClient(c.controller_address, timeout_s=5.0) as client:
        s = await client.schedule()
        events = [e async for e in client.watch(recent=50, follow=False)]
    (repack,) = [a for a in s.actions if a["kind"] == "repack"]
    assert repack["ok"] and repack["node"] == "gen0-n1" and repack["requests"] == ["tail-a"]
    assert "1 of 1 request(s) moved, 1 of 1 reshard(s) done" in repack["message"]
    assert any(e.kind == "compute_repack" for e in events)
    # a repack carried out is not repeated: one node now holds the whole tail
    again = await decided(c)
    assert again.mode != "repack", again.plan and again.plan.explain()


async def test_in_phased_mode_the_tail_is_left_to_the_step_planner(cluster: Cluster) -> None:
    c = cluster
    await seed_one_on_each_node(c)
    decision = await c.scheduler.round()
    assert decision.mode == "replan", decision.why
