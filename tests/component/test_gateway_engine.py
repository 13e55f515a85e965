"""The gateway engine over scripted instances: admission, migration, reshard, crashes.

The scripted instances continue any prefix the same way (like greedy decoding of one
model), so every test checks the property the gateway exists for: whatever happens to a
request on the way, its client reads exactly what one uninterrupted call would give.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from node_agent.engine import Destination, EngineState
from node_agent.engines.base import Placement, Sampling
from node_agent.gateway.engine import GatewayConfig, GatewayEngine
from node_agent.gateway.requests import Request, RequestFailed, Where
from orchestrrl import errors
from sim_backends.token_engine import EngineRecord, Hold, LocalPeers, ScriptedEngine, greedy
from tests.helpers import FakeClock, eventually

pytestmark = pytest.mark.component

GREEDY = Sampling(temperature=0.0)


@dataclass
class Node:
    name: str
    engine: GatewayEngine
    record: EngineRecord
    servers: list[ScriptedEngine] = field(default_factory=list)

    def live(self) -> list[ScriptedEngine]:
        return [s for s in self.servers if s.alive]


class Cluster:
    def __init__(self) -> None:
        self.peers = LocalPeers()
        self.nodes: dict[str, Node] = {}

    async def add(
        self,
        name: str,
        layout: tuple[int, ...] = (1, 1),
        *,
        seats: int = 4,
        delay: float = 0.002,
        tune: Callable[[ScriptedEngine], None] | None = None,
        config: GatewayConfig | None = None,
        hold: Hold | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Node:
        record = EngineRecord()
        node = Node(name, None, record)  # type: ignore[arg-type]

        def make(p: Placement) -> ScriptedEngine:
            s = ScriptedEngine(p, record, max_num_seqs=seats, token_delay_s=delay, hold=hold)
            if tune is not None:
                tune(s)
            node.servers.append(s)
            return s

        node.engine = GatewayEngine(
            "scripted",
            sum(layout),
            layout,
            make,
            lambda p: 9000 + p.devices[0],
            peers=self.peers,
            node=name,
            config=config or GatewayConfig(restart_backoff_s=(0.01, 0.01)),
            clock=clock,
        )
        await node.engine.start()
        self.nodes[name] = node
        self.peers.gateways[name] = node.engine
        return node

    async def close(self) -> None:
        for node in self.nodes.values():
            await node.engine.close()


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


async def read_all(req: Request) -> list[int]:
    out: list[int] = []
    async for chunk in req.tokens():
        out.extend(chunk)
    return out


def prompt(i: int) -> tuple[int, ...]:
    return (1 + i, 2 + i, 3)


async def test_requests_beyond_the_seats_queue_and_all_finish(cluster: Cluster) -> None:
    node = await cluster.add("a", (1, 1), seats=2)
    reqs = [node.engine.submit(prompt(i), 20, GREEDY) for i in range(7)]
    await asyncio.sleep(0)
    stats = node.engine.stats()
    assert stats.running_requests + stats.queued_requests == 7
    progress = node.engine.progress()
    queued = [r for r in progress.requests if r.instance == -1]
    assert len(queued) == 3 and {r.request_id for r in queued} == {r.id for r in reqs[4:]}
    outs = await asyncio.gather(*(read_all(r) for r in reqs))
    for i, out in enumerate(outs):
        assert out == greedy(prompt(i), 20)
    assert sorted(node.engine.progress().completed_lengths) == [20] * 7
    assert node.engine.stats().running_requests == 0
    # the client has read them: forgotten
    for r in reqs:
        node.engine.release(r)
    assert node.engine.request(reqs[0].id) is None


async def test_drain_stops_admission_until_resume(cluster: Cluster) -> None:
    node = await cluster.add("a", (1, 1))
    await node.engine.drain()
    req = node.engine.submit(prompt(0), 5, GREEDY)
    await asyncio.sleep(0.05)
    assert req.where is Where.QUEUED and req.output == []
    assert node.engine.state is EngineState.DRAINED
    await node.engine.resume()
    assert await read_all(req) == greedy(prompt(0), 5)


async def test_a_new_step_starts_when_requests_arrive_at_an_idle_node(cluster: Cluster) -> None:
    node = await cluster.add("a", (2,))
    await read_all(node.engine.submit(prompt(0), 3, GREEDY))
    assert node.engine.progress().step == 0
    assert node.engine.progress().completed_lengths == (3,)
    await read_all(node.engine.submit(prompt(1), 4, GREEDY))
    assert node.engine.progress().step == 1
    assert node.engine.progress().completed_lengths == (4,)


async def test_a_requests_group_is_reported_and_moves_with_it(cluster: Cluster) -> None:
    """The sample group the RL framework names (GRPO: the prompt) is in the progress the
    controller plans with, survives a migration, and is listed with the completion."""
    a = await cluster.add("a", (1, 1))
    b = await cluster.add("b", (2,))
    req = a.engine.submit(prompt(0), 30, GREEDY, group="prompt-41")
    plain = a.engine.submit(prompt(1), 5, GREEDY)
    reader = asyncio.create_task(read_all(req))
    await read_all(plain)
    assert {p.request_id: p.group for p in a.engine.progress().requests} == {req.id: "prompt-41"}
    assert a.engine.progress().completed_groups == ()  # none of its completions has a group
    await eventually(lambda: len(req.output) >= 3)
    await migrate(a, b, [req.id])
    assert await reader == greedy(prompt(0), 30)
    assert b.engine.progress().completed_lengths == (30,)
    assert b.engine.progress().completed_groups == ("prompt-41",)
    with pytest.raises(errors.InvalidArgument, match="group"):
        a.engine.submit(prompt(0), 3, GREEDY, group="g" * 129)


async def migrate(
    src: Node, dst: Node, ids: list[str], instance: int = 0, recompute: bool = True
) -> tuple[str, ...]:
    exported, missing = await src.engine.export_requests(ids)
    assert not missing
    result = await dst.engine.import_requests(exported, instance, recompute)
    await src.engine.release_requests(exported, Destination(dst.name, f"{dst.name}:1"))
    return result.admitted


@pytest.mark.parametrize("cut", [0, 1, 7, 29])
async def test_migration_mid_response_splices_into_one_uninterrupted_stream(
    cluster: Cluster, cut: int
) -> None:
    hold = Hold(len(prompt(0)) + cut)  # the request stops at ``cut`` tokens on ``a``
    a = await cluster.add("a", (1, 1), hold=hold)
    b = await cluster.add("b", (2,))
    req = a.engine.submit(prompt(0), 30, GREEDY)
    reader = asyncio.create_task(read_all(req))
    await eventually(lambda: len(req.output) == cut and len(hold.held) == 1)
    admitted = await migrate(a, b, [req.id])
    assert admitted == (req.id,)
    assert await reader == greedy(prompt(0), 30)
    assert req.where is Where.FINISHED and req.hops == ["a", "b"]
    # the destination counts the completion; the imported record is gone once followed
    assert b.engine.progress().completed_lengths == (30,)
    await eventually(lambda: b.engine.request(req.id) is None)
    # the destination's one call carried the source's ``cut`` tokens as prompt
    [(_, sub)] = b.record.submissions
    assert sub.prompt == prompt(0) + tuple(greedy(prompt(0), cut)) and sub.max_tokens == 30 - cut


async def test_a_queued_request_migrates_too(cluster: Cluster) -> None:
    a = await cluster.add("a", (1,), seats=1, hold=Hold(len(prompt(0)) + 1))
    b = await cluster.add("b", (2,))
    first = a.engine.submit(prompt(0), 30, GREEDY)  # takes the seat
    req = a.engine.submit(prompt(1), 30, GREEDY)
    assert req.where is Where.QUEUED
    reader = asyncio.create_task(read_all(req))
    assert await migrate(a, b, [req.id]) == (req.id,)
    assert await reader == greedy(prompt(1), 30)
    assert req.hops == ["a", "b"] and first.where is Where.RUNNING
    [(_, sub)] = b.record.submissions
    assert sub.prompt == prompt(1) and sub.max_tokens == 30


async def test_a_call_cancelled_before_its_task_ran_frees_its_seat(cluster: Cluster) -> None:
    """A request exported in the same event-loop step that dispatched it: its call's task
    is cancelled before it first runs (so none of its code runs). Its seat must still be
    freed, else a later weight update waits for it until its drain timeout (seen in the
    async RL demo: an update stuck 600 s on a node the controller migrated from)."""
    a = await cluster.add("a", (1,), seats=2)
    b = await cluster.add("b", (2,))
    req = a.engine.submit(prompt(0), 30, GREEDY)  # its call's task exists, has not run
    assert req.where is Where.RUNNING and a.engine.core.seats_taken() == 1
    reader = asyncio.create_task(read_all(req))
    assert await migrate(a, b, [req.id]) == (req.id,)  # export: no await before the hold
    assert a.engine.core.seats_taken() == 0
    assert await reader == greedy(prompt(0), 30)
    assert req.hops == ["a", "b"]
    update = await a.engine.update_weights("/ckpt/scripted-2", "v2", "resume", drain_timeout_s=60.0)
    assert update.version == "v2" and a.engine.weight_version == "v2"
    after = a.engine.submit(prompt(1), 5, GREEDY)
    assert await read_all(after) == greedy(prompt(1), 5, weights=2)


async def test_an_update_that_takes_off_a_call_not_yet_started_completes(
    cluster: Cluster,
) -> None:
    """The same from the update's side: the update begins (the scripted engine prepares
    without waiting) in the step that dispatched a request, and takes its call off before
    the call's task ran; the update must not wait for that seat, and the request resumes
    on the new weights, every token tagged with them."""
    a = await cluster.add("a", (1,), seats=2)
    req = a.engine.submit(prompt(0), 30, GREEDY)  # its call's task exists, has not run
    update = await a.engine.update_weights("/ckpt/scripted-2", "v2", "resume", drain_timeout_s=60.0)
    assert update.resumed == 1 and a.engine.weight_version == "v2"
    assert await read_all(req) == greedy(prompt(0), 30, weights=2)
    assert req.versions == [(0, "v2")]


async def test_a_request_moves_on_and_comes_home(cluster: Cluster) -> None:
    # each node holds the request at the point where it moves on
    at = {name: Hold(len(prompt(3)) + n) for name, n in (("a", 5), ("b", 20), ("c", 35))}
    a = await cluster.add("a", (1, 1), hold=at["a"])
    b = await cluster.add("b", (1, 1), hold=at["b"])
    c = await cluster.add("c", (2,), hold=at["c"])

    def held_at(node: Node, n: int) -> bool:
        r = node.engine.request(req.id)
        return r is not None and len(r.output) == n and len(at[node.name].held) == 1

    req = a.engine.submit(prompt(3), 60, GREEDY)
    reader = asyncio.create_task(read_all(req))
    await eventually(lambda: held_at(a, 5))
    await migrate(a, b, [req.id], 1)
    at["a"].release()  # it comes home later and finishes there
    await eventually(lambda: held_at(b, 20))
    await migrate(b, c, [req.id])
    await eventually(lambda: held_at(c, 35))
    await migrate(c, a, [req.id])  # home: the client's own gateway runs it again
    assert await reader == greedy(prompt(3), 60)
    assert req.hops == ["a", "b", "c", "a"]
    assert req.where is Where.FINISHED


async def test_imports_are_checked_and_change_nothing_when_refused(cluster: Cluster) -> None:
    a = await cluster.add("a", (1, 1))
    b = await cluster.add("b", (1, 1), seats=1)
    reqs = [a.engine.submit(prompt(i), 500, GREEDY) for i in range(3)]
    await eventually(lambda: all(len(r.output) > 0 for r in reqs[:2]))
    exported, _ = await a.engine.export_requests([r.id for r in reqs])
    with pytest.raises(errors.InvalidArgument, match="each request id once"):
        await b.engine.import_requests([exported[0], exported[0]], 0, True)
    with pytest.raises(errors.InvalidArgument, match="instance=5"):
        await b.engine.import_requests(exported[:1], 5, True)
    await b.engine.drain()
    with pytest.raises(errors.FailedPrecondition, match="not admitting"):
        await b.engine.import_requests(exported[:1], 0, True)
    await b.engine.resume()
    assert b.engine.progress().requests == ()
    await b.engine.import_requests(exported[:1], 0, True)
    with pytest.raises(errors.InvalidArgument, match="does not have yet"):
        await b.engine.import_requests(exported[:1], 1, True)
    # what was not admitted goes back where it was
    assert await a.engine.restore_requests(exported[1:]) == (reqs[1].id, reqs[2].id)
    assert all(r.where in (Where.QUEUED, Where.RUNNING) for r in reqs[1:])


async def test_an_import_beyond_the_instances_seats_queues_the_rest_on_the_node(
    cluster: Cluster,
) -> None:
    a = await cluster.add("a", (1, 1), delay=0.003)
    b = await cluster.add("b", (1, 1), seats=1, delay=0.003)
    reqs = [a.engine.submit(prompt(i), 60, GREEDY) for i in range(3)]
    readers = [asyncio.create_task(read_all(r)) for r in reqs]
    await eventually(lambda: all(len(r.output) > 3 for r in reqs))
    exported, _ = await a.engine.export_requests([r.id for r in reqs])
    result = await b.engine.import_requests(exported, 0, True)
    assert set(result.admitted) == {r.id for r in reqs}
    assert "1 request(s) on instance 0" in result.message
    assert "2 queued for this node's next free seat" in result.message  # then instance 1
    await a.engine.release_requests(exported, Destination("b", "b:1"))
    assert await asyncio.gather(*readers) == [greedy(prompt(i), 60) for i in range(3)]


async def test_reshard_with_requests_in_flight_completes_every_request(cluster: Cluster) -> None:
    node = await cluster.add("a", (1, 1, 1, 1), seats=2, delay=0.003)
    reqs = [node.engine.submit(prompt(i), 80, GREEDY) for i in range(11)]
    readers = [asyncio.create_task(read_all(r)) for r in reqs]
    for layout in [(2, 2), (4,), (1, 1, 2), (2, 1, 1)]:
        await eventually(lambda: sum(len(r.output) for r in reqs) > 40)
        result = await node.engine.reshard(layout)
        assert result.new_layout == layout
        assert [s.stage for s in result.stages] == [
            "export_requests",
            "stop_instances",
            "start_instances",
            "resubmit_requests",
        ]
        assert node.engine.tp_layout == layout
        assert [p.tp for p in node.engine.instances] == list(layout)
    outs = await asyncio.gather(*readers)
    assert outs == [greedy(prompt(i), 80) for i in range(11)]
    assert len(node.engine.progress().completed_lengths) == 11


async def test_reshard_keeps_instances_whose_devices_do_not_change(cluster: Cluster) -> None:
    node = await cluster.add("a", (2, 1, 1), delay=0.003)
    req = node.engine.submit(prompt(0), 200, GREEDY)
    await eventually(lambda: len(req.output) > 3)
    assert req.instance == 0
    started = len(node.record.started)
    result = await node.engine.reshard((2, 2))
    assert len(node.record.started) == started + 1  # only the new TP2 on devices 2-3
    assert "kept 1 running" in result.message
    assert req.where is Where.RUNNING and req.instance == 0
    assert req.calls == 1  # never interrupted
    assert await read_all(req) == greedy(prompt(0), 200)


async def test_a_failed_reshard_brings_the_old_layout_back(cluster: Cluster) -> None:
    fail = {"on": False}

    def tune(s: ScriptedEngine) -> None:
        if fail["on"] and s.placement.tp == 4:
            s.fail_starts = 1

    node = await cluster.add("a", (2, 2), tune=tune, delay=0.003)
    reqs = [node.engine.submit(prompt(i), 50, GREEDY) for i in range(3)]
    readers = [asyncio.create_task(read_all(r)) for r in reqs]
    await eventually(lambda: all(r.output for r in reqs))
    fail["on"] = True
    with pytest.raises(errors.FailedPrecondition, match=r"old layout \[2, 2\] serves again"):
        await node.engine.reshard((4,))
    assert node.engine.tp_layout == (2, 2)
    assert await asyncio.gather(*readers) == [greedy(prompt(i), 50) for i in range(3)]


async def test_a_crashed_instance_is_restarted_and_its_requests_resume(cluster: Cluster) -> None:
    node = await cluster.add("a", (1, 1), seats=2, delay=0.003)
    reqs = [node.engine.submit(prompt(i), 60, GREEDY) for i in range(4)]
    readers = [asyncio.create_task(read_all(r)) for r in reqs]
    await eventually(lambda: all(len(r.output) > 5 for r in reqs))
    node.live()[0].crash()
    assert await asyncio.gather(*readers) == [greedy(prompt(i), 60) for i in range(4)]
    assert node.engine.failures == 1
    assert node.engine.instance_health() == ("up", "up")


async def test_when_no_instance_can_restart_requests_fail_with_the_reason(
    cluster: Cluster,
) -> None:
    node = await cluster.add("a", (2,), delay=0.003)
    req = node.engine.submit(prompt(0), 500, GREEDY)
    await eventually(lambda: len(req.output) > 3)
    server = node.live()[0]
    server.fail_starts = 99
    server.crash(137)
    with pytest.raises(RequestFailed, match="exited with status 137 and did not restart"):
        await read_all(req)
    assert node.engine.instance_health()[0].startswith("failed:")
    assert len(req.output) > 3  # what was delivered stays delivered


async def test_calls_that_fail_are_retried_then_the_request_fails(cluster: Cluster) -> None:
    node = await cluster.add("a", (1,))
    node.live()[0].fail_calls = 2
    req = node.engine.submit(prompt(0), 10, GREEDY)
    assert await read_all(req) == greedy(prompt(0), 10)
    node.live()[0].fail_calls = 3
    req = node.engine.submit(prompt(1), 10, GREEDY)
    with pytest.raises(RequestFailed, match="failed 3 times"):
        await read_all(req)


async def test_a_lost_destination_resumes_the_request_at_its_source(cluster: Cluster) -> None:
    a = await cluster.add("a", (1, 1), delay=0.003)
    b = await cluster.add("b", (1, 1), delay=0.003)
    req = a.engine.submit(prompt(0), 80, GREEDY)
    reader = asyncio.create_task(read_all(req))
    await eventually(lambda: len(req.output) > 10)
    await migrate(a, b, [req.id])
    await eventually(lambda: len(req.output) > 30)
    cluster.peers.down.add("b")
    await b.engine.close()  # the destination's agent stops
    assert await reader == greedy(prompt(0), 80)
    assert req.hops == ["a", "b", "a"]


async def test_an_import_nobody_follows_is_aborted_after_the_grace(cluster: Cluster) -> None:
    # b's grace runs on a fake clock, and b holds the request at 50 tokens: it runs on
    # b until the test says otherwise
    clock = FakeClock()
    config = GatewayConfig(orphan_grace_s=0.1)
    b = await cluster.add("b", (1,), config=config, hold=Hold(3 + 50), clock=clock)
    a = await cluster.add("a", (1,))
    req = a.engine.submit(prompt(0), 1000, GREEDY)
    await eventually(lambda: len(req.output) > 2)
    await migrate(a, b, [req.id])
    await eventually(lambda: len(req.output) == 50)  # a follows it on b
    clock.now += 1.0  # long past the grace: a followed request stays
    await asyncio.sleep(0.2)  # (the reaper looks every 0.05 s)
    moved = b.engine.request(req.id)
    assert moved is not None

    def where() -> Where:
        assert moved is not None
        return moved.where

    assert where() is Where.RUNNING
    assert a.engine.abort([req.id]) == []  # the client goes away: a stops following
    await asyncio.sleep(0.2)
    assert where() is Where.RUNNING  # not yet: no time has passed on b's clock

    def reaped() -> bool:
        clock.now += 0.01  # from now on, b's clock moves
        return b.engine.request(req.id) is None

    await eventually(reaped)
    assert where() is Where.ABORTED and b.engine.stats().running_requests == 0


async def test_client_abort_and_unknown_ids(cluster: Cluster) -> None:
    node = await cluster.add("a", (1,))
    req = node.engine.submit(prompt(0), 1000, GREEDY)
    await eventually(lambda: len(req.output) > 0)
    assert node.engine.abort([req.id, "nope"]) == ["nope"]
    with pytest.raises(RequestFailed, match="aborted by the client") as info:
        await read_all(req)
    assert info.value.aborted
    assert node.engine.stats().running_requests == 0


async def test_bad_submissions_are_refused(cluster: Cluster) -> None:
    node = await cluster.add("a", (1,), config=GatewayConfig(max_queue=1))
    with pytest.raises(errors.InvalidArgument, match="max_tokens=0"):
        node.engine.submit(prompt(0), 0, GREEDY)
    with pytest.raises(errors.InvalidArgument, match="prompt"):
        node.engine.submit((), 3, GREEDY)
    with pytest.raises(errors.InvalidArgument, match="temperature"):
        node.engine.submit(prompt(0), 3, Sampling(temperature=-1))
    await node.engine.drain()
    node.engine.submit(prompt(0), 3, GREEDY, "x")
    with pytest.raises(errors.InvalidArgument, match="request_id='x'"):
        node.engine.submit(prompt(0), 3, GREEDY, "x")
    with pytest.raises(errors.FailedPrecondition, match="queue is full"):
        node.engine.submit(prompt(0), 3, GREEDY)


async def test_an_unreachable_instance_is_checked_then_used_again(cluster: Cluster) -> None:
    node = await cluster.add("a", (1, 1), delay=0.003)
    server = node.live()[0]
    server.hung = True  # refuses connections for a while, its process still runs
    reqs = [node.engine.submit(prompt(i), 30, GREEDY) for i in range(4)]
    await eventually(lambda: node.engine.instance_health()[0] != "up")
    server.hung = False
    assert await asyncio.gather(*(read_all(r) for r in reqs)) == [
        greedy(prompt(i), 30) for i in range(4)
    ]
    await eventually(lambda: node.engine.instance_health() == ("up", "up"))
    assert all(r.failures == 0 for r in reqs)  # not the requests' fault


async def test_a_hung_instance_is_restarted(cluster: Cluster) -> None:
    node = await cluster.add(
        "a", (1,), config=GatewayConfig(hung_after_s=0.5, restart_backoff_s=(0.01,))
    )
    server = node.live()[0]
    server.hung = True
    req = node.engine.submit(prompt(0), 20, GREEDY)
    await eventually(lambda: node.record.stopped != [])  # stopped as hung
    server.hung = False  # the restart brings it back
    assert await read_all(req) == greedy(prompt(0), 20)
    assert node.engine.failures == 1


async def test_a_request_moves_between_instances_of_its_node(cluster: Cluster) -> None:
    a = await cluster.add("a", (1, 1), delay=0.003)
    req = a.engine.submit(prompt(0), 60, GREEDY)
    reader = asyncio.create_task(read_all(req))
    await eventually(lambda: len(req.output) > 10)
    before = req.instance
    exported, _ = await a.engine.export_requests([req.id])
    await a.engine.import_requests(exported, 1 - before, recompute=True)
    assert req.where is Where.RUNNING and req.instance == 1 - before
    # the controller then resolves the export: nothing to release or restore any more
    assert await a.engine.release_requests(exported, Destination("a", "x")) == ()
    assert await a.engine.restore_requests(exported) == ()
    assert await reader == greedy(prompt(0), 60)
    assert req.hops == ["a"]


async def test_a_gateway_task_that_dies_fails_the_gateway_loudly(cluster: Cluster) -> None:
    """An unexpected error in any of the gateway's tasks (here a call's: an adapter bug)
    is not swallowed: every request in flight fails naming it, health turns bad, new
    requests are refused and ``wait_failed`` returns (the agent then exits)."""
    node = await cluster.add("a", (1, 1), delay=0.01)
    running = node.engine.submit(prompt(0), 1000, GREEDY)
    await eventually(lambda: len(running.output) > 0)
    for server in node.live():  # the running call has started: only new calls raise
        server.bug = ZeroDivisionError("adapter bug")
    doomed = node.engine.submit(prompt(1), 10, GREEDY)
    why = await asyncio.wait_for(node.engine.wait_failed(), 10)
    assert "ZeroDivisionError('adapter bug')" in why
    for req in (running, doomed):
        with pytest.raises(RequestFailed, match="adapter bug"):
            await read_all(req)
    assert all(h.startswith("failed: a gateway task died") for h in node.engine.instance_health())
    with pytest.raises(errors.Unavailable, match="gateway failed"):
        node.engine.submit(prompt(2), 3, GREEDY)


async def test_the_agent_stops_with_an_error_when_its_gateway_fails(cluster: Cluster) -> None:
    from node_agent.daemon import _stop_or_gateway_failure

    node = await cluster.add("a", (1,), delay=0.01)
    never = asyncio.Event()
    waiting = asyncio.create_task(_stop_or_gateway_failure(never.wait, node.engine))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    node.live()[0].bug = RuntimeError("boom")
    node.engine.submit(prompt(0), 5, GREEDY)
    assert "RuntimeError('boom')" in await asyncio.wait_for(waiting, 10)
    stop = asyncio.Event()
    stop.set()
    assert await _stop_or_gateway_failure(stop.wait, None) == ""


async def test_logprobs_and_versions_survive_a_migration_and_a_reshard(cluster: Cluster) -> None:
    from sim_backends.token_engine import greedy_logprobs

    a = await cluster.add("a", (1, 1), delay=0.003)
    b = await cluster.add("b", (2,), delay=0.003)
    req = a.engine.submit(prompt(0), 90, GREEDY, logprobs=True)
    reader = asyncio.create_task(read_all(req))
    await eventually(lambda: len(req.output) >= 10)
    await migrate(a, b, [req.id])
    await eventually(lambda: (r := b.engine.request(req.id)) is not None and len(r.output) > 40)
    await b.engine.reshard((1, 1))
    await eventually(lambda: (r := b.engine.request(req.id)) is not None and len(r.output) > 60)
    await migrate(b, a, [req.id])
    assert await reader == greedy(prompt(0), 90)
    assert req.logprobs == greedy_logprobs(prompt(0), req.output)
    assert req.versions == [(0, "0")] and req.hops == ["a", "b", "a"]


async def test_an_engine_that_gives_no_logprobs_fails_the_request_clearly(
    cluster: Cluster,
) -> None:
    node = await cluster.add("a", (1,))
    real = node.live()[0].generate

    def without_logprobs(sub):  # type: ignore[no-untyped-def]
        return real(dataclasses.replace(sub, logprobs=False))

    node.live()[0].generate = without_logprobs  # type: ignore[method-assign]
    req = node.engine.submit(prompt(0), 5, GREEDY, logprobs=True)
    with pytest.raises(RequestFailed, match="did not report the sampled tokens' logprobs"):
        await read_all(req)
    assert req.refused and req.output == []
