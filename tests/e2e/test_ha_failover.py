"""Controller high availability on real etcd (issue 17): controller daemons as
subprocesses sharing one etcd cluster and one simulated OCS.

- a standby answers with the leader's address (status, message, trailing metadata);
- kill -9 of the leader during a phase change (the stage is a parameter): a standby
  takes over, recovers, the change completes through the client, no committed epoch is
  lost or duplicated, the switch holds the committed circuits, a retried request id gets
  its first outcome;
- SIGSTOP of the leader past its lease during a phase change: a standby takes over and
  changes the phase; resumed, the old leader programs nothing, steps down and says so in
  its log and events;
- one etcd member of three lost: nothing visible changes; two lost: phase changes fail
  with UNAVAILABLE and nothing changes; service resumes when the quorum is back.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orchestrrl import errors
from orchestrrl.client import AsyncClient
from orchestrrl.convert import phase_to_pb
from orchestrrl.leader import LEADER_METADATA_KEY
from orchestrrl.model import Circuit, Phase
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc
from sim_backends.etcd_cluster import EtcdCluster
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import serve as serve_ocs
from tests.e2e.test_controller_crash import ControllerProcess, start_controller, table

pytest_plugins = ["tests.etcd_fixtures"]
pytestmark = pytest.mark.e2e

TTL = 2
TRAINING = phase_to_pb(Phase.TRAINING)
TAKEOVER_S = TTL + 13  # a lease, a campaign and a recovery, on a loaded 2-core machine


@pytest.fixture
async def ocs() -> AsyncIterator[tuple[str, SimulatedOcs]]:
    server, sim = await serve_ocs("127.0.0.1:0", port_count=32, switching_time_s=0.0)
    try:
        yield server.address, sim
    finally:
        await server.stop(0.1)


class Group:
    """Controllers of one HA group (named a, b, c, ...), stopped at the end."""

    def __init__(self, tmp: Path, etcd: EtcdCluster, ocs_address: str) -> None:
        self.tmp = tmp
        self.etcd = etcd
        self.ocs_address = ocs_address
        self.procs: dict[str, ControllerProcess] = {}

    async def start(self, name: str, crash_at: str = "", stop_at: str = "") -> ControllerProcess:
        proc = await start_controller(
            self.tmp, self.ocs_address, crash_at, name=name,
            state=["--etcd", ",".join(self.etcd.endpoints)],
            extra=["--election-ttl", str(TTL)],
            env={"ORL_FAULT_STOP_AT": stop_at},
        )  # fmt: skip
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> list[dict[str, object]]:
        lines = (self.tmp / f"{name}.log").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def token(self, name: str) -> int:
        """The fencing token of the last term ``name`` led (from its log)."""
        terms = [e for e in self.log(name) if e.get("event") == "leading"]
        assert terms, f"{name} never led"
        return int(str(terms[-1]["token"]))

    async def close(self) -> None:
        for proc in self.procs.values():
            if proc.proc.returncode is None:
                proc.proc.send_signal(signal.SIGCONT)
                await proc.stop()


@pytest.fixture
async def group(
    tmp_path: Path, etcd1: EtcdCluster, ocs: tuple[str, SimulatedOcs]
) -> AsyncIterator[Group]:
    g = Group(tmp_path, etcd1, ocs[0])
    try:
        yield g
    finally:
        await g.close()


async def ask(address: str) -> tuple[grpc.StatusCode, str, str | None]:
    """GetPhase on one controller: (status, details, the orl-leader metadata)."""
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await pb_grpc.FabricControllerStub(ch).GetPhase(pb.GetPhaseRequest(), timeout=5)
            return grpc.StatusCode.OK, "", None
        except grpc.aio.AioRpcError as exc:
            named = dict(exc.trailing_metadata() or ()).get(LEADER_METADATA_KEY)
            return exc.code(), exc.details() or "", None if named is None else str(named)


async def until_leads(proc: ControllerProcess, timeout_s: float = TAKEOVER_S) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if (await ask(proc.address))[0] == grpc.StatusCode.OK:
                return
            await asyncio.sleep(0.1)


async def until_names(proc: ControllerProcess, leader: str, timeout_s: float = 10) -> None:
    """Until ``proc`` answers as a standby naming ``leader``."""
    want = (grpc.StatusCode.UNAVAILABLE, f"not the leader; the leader is at {leader}", leader)
    async with asyncio.timeout(timeout_s):
        while True:
            if await ask(proc.address) == want:
                return
            await asyncio.sleep(0.1)


def stopped(proc: ControllerProcess) -> bool:
    """The process is stopped (SIGSTOP): state T in /proc."""
    stat = Path(f"/proc/{proc.proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def committed(etcd: EtcdCluster) -> list[tuple[int, str, str | None]]:
    """Every committed epoch in etcd (number, phase, request id), and no journal left."""
    from fabric_controller.etcd_store import Etcd, EtcdStore

    conn = Etcd(etcd.endpoints)
    try:
        store = EtcdStore(conn)
        head = (await store.current()).epoch
        out = []
        for n in range(1, head + 1):
            r = await store.epoch(n)
            assert r.phase is not None
            out.append((r.epoch, r.phase.value, r.request_id))
        assert await store.pending() is None
        return out
    finally:
        await conn.close()


async def test_a_standby_names_the_leader(group: Group, ocs: tuple[str, SimulatedOcs]) -> None:
    a = await group.start("a")
    await until_leads(a)
    b = await group.start("b")
    await until_names(b, a.address)
    code, details, named = await ask(b.address)
    assert (code, named) == (grpc.StatusCode.UNAVAILABLE, a.address)
    assert details == f"not the leader; the leader is at {a.address}"
    async with grpc.aio.insecure_channel(b.address) as ch:  # agents go to the leader too
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.FabricControllerStub(ch).Register(
                pb.RegisterRequest(node="gpu-node-0", agent_address="127.0.0.1:1"), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # the client, given the standby first, follows it to the leader
    async with AsyncClient([b.address, a.address], timeout_s=20) as c:
        r = await c.set_phase("training", request_id="t-1")
        assert r.epoch == 1 and c.address == a.address
    assert table(ocs[1]) == {Circuit(x.ocs, x.a, x.b) for x in r.circuits}
    assert ocs[1].fencing.newest == group.token("a") > 0  # every batch carries the token


@pytest.mark.parametrize(
    ("stage", "first_outcome"),
    [
        ("planned", False),  # rolled back by the new leader: the retry is a fresh change
        ("program_ocs", True),  # the switch holds the whole epoch: rolled forward
        ("ocs_programmed", True),  # every batch acknowledged: rolled forward
        ("committed", True),  # committed, the answer lost: the retry gets it
    ],
)
async def test_leader_killed_during_a_phase_change(
    group: Group, ocs: tuple[str, SimulatedOcs], stage: str, first_outcome: bool
) -> None:
    sim = ocs[1]
    a = await group.start("a")
    await until_leads(a)
    async with AsyncClient([a.address], timeout_s=20) as c:
        training = await c.set_phase("training", request_id="t-1")
    b = await group.start("b", crash_at=stage)  # the doomed one, a standby first
    await until_names(b, a.address)
    assert await a.stop() == 0  # a resigns: b leads at once, its recovery changes nothing
    await until_leads(b)
    c3 = await group.start("c")
    await until_names(c3, b.address)

    async with AsyncClient([b.address, c3.address], timeout_s=40) as c:
        # b dies at `stage`; the client carries the same request to c once it leads
        r = await c.set_phase("weight-sync", request_id="w-1")
        assert await asyncio.wait_for(b.proc.wait(), 10) == -signal.SIGKILL
        assert c.address == c3.address
        assert (r.epoch, r.phase, r.changed) == (2, "weight-sync", not first_outcome)
        want = {Circuit(x.ocs, x.a, x.b) for x in r.circuits}
        assert table(sim) == want
        again = await c.set_phase("weight-sync", request_id="w-1")
        assert (again.epoch, again.changed) == (2, False)
        assert "already applied" in again.message
        got = await c.get_phase()
        assert got.epoch == 2 and {Circuit(x.ocs, x.a, x.b) for x in got.circuits} == want
        nxt = await c.set_phase("generation", request_id="g-1")
        assert nxt.epoch == 3 and table(sim) == {Circuit(x.ocs, x.a, x.b) for x in nxt.circuits}
    assert training.epoch == 1
    assert await committed(group.etcd) == [
        (1, "training", "t-1"),
        (2, "weight-sync", "w-1"),
        (3, "generation", "g-1"),
    ]
    assert group.token("c") > group.token("b") > group.token("a")
    assert sim.fencing.newest == group.token("c")
    recovered = [str(e["message"]) for e in group.log("c") if e.get("event") == "recovered"]
    how = {"planned": ["rolled back"], "committed": []}.get(stage, ["rolled forward"])
    assert [m for m in ("rolled back", "rolled forward") if any(m in r for r in recovered)] == how


@pytest.mark.parametrize("stage", ["planned", "ocs_programmed"])
async def test_frozen_leader_programs_nothing_and_steps_down(
    group: Group, ocs: tuple[str, SimulatedOcs], stage: str
) -> None:
    sim = ocs[1]
    a = await group.start("a", stop_at=stage)
    await until_leads(a)
    b = await group.start("b")
    await until_names(b, a.address)
    events: list[pb.Event] = []
    async with grpc.aio.insecure_channel(a.address) as ch:
        stub = pb_grpc.FabricControllerStub(ch)
        watch = stub.WatchEvents(pb.WatchEventsRequest(follow=True))

        async def follow() -> grpc.StatusCode:
            try:
                async for e in watch:
                    events.append(e)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        watching = asyncio.create_task(follow())

        async def set_training() -> pb.SetPhaseResponse:
            req = pb.SetPhaseRequest(phase=TRAINING, request_id="t-1")
            r: pb.SetPhaseResponse = await stub.SetPhase(req, timeout=60)
            return r

        change = asyncio.create_task(set_training())
        async with asyncio.timeout(20):
            while True:
                if stopped(a):
                    break
                await asyncio.sleep(0.05)
        await until_leads(b)  # after a's lease ran out: b recovers a's journal
        async with AsyncClient([b.address], timeout_s=20) as c:
            w = await c.set_phase("weight-sync", request_id="w-1")
        want = {Circuit(x.ocs, x.a, x.b) for x in w.circuits}
        assert table(sim) == want
        before = await committed(group.etcd)

        a.proc.send_signal(signal.SIGCONT)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await change
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (refused.value.details() or "").startswith("not the leader")
        assert await asyncio.wait_for(watching, 10) == grpc.StatusCode.UNAVAILABLE

    # it programmed nothing: the switch holds b's epoch, stamped with b's token
    assert table(sim) == want
    assert sim.fencing.newest == group.token("b") > group.token("a")
    assert await committed(group.etcd) == before
    assert before[-1] == (len(before), "weight-sync", "w-1")
    # it says so, in its events and its log, and serves as a standby naming b
    kinds = [e.kind for e in events]
    assert "stepped_down" in kinds and "epoch_committed" not in kinds
    down = [e for e in group.log("a") if e.get("event") == "stepped_down"]
    assert down and down[0]["level"] == "warning" and down[0]["reason"]
    await until_names(a, b.address)
    assert a.proc.returncode is None


async def etcd_follower(cluster: EtcdCluster) -> int:
    """A member that is not etcd's raft leader (losing the leader costs an election, which
    a 2 s lease may or may not ride out: that is not this test's subject)."""

    def status(i: int) -> dict[str, object]:
        req = urllib.request.Request(
            f"http://{cluster.members[i].endpoint}/v3/maintenance/status", data=b"{}"
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            answer: dict[str, object] = json.loads(r.read())
            return answer

    for i in range(cluster.size):
        got = await asyncio.to_thread(status, i)
        header = got["header"]
        assert isinstance(header, dict)
        if header["member_id"] != got["leader"]:
            return i
    raise AssertionError("every member says it leads")


async def test_etcd_quorum_lost_and_regained(
    tmp_path: Path, etcd3: EtcdCluster, ocs: tuple[str, SimulatedOcs]
) -> None:
    sim = ocs[1]
    g = Group(tmp_path, etcd3, ocs[0])
    try:
        a = await g.start("a")
        await until_leads(a)
        b = await g.start("b")
        await until_names(b, a.address)
        addresses = [a.address, b.address]
        async with AsyncClient(addresses, timeout_s=20) as c:
            await c.set_phase("training", request_id="t-1")
            follower = await etcd_follower(etcd3)
            etcd3.kill(follower)  # one of three: nothing visible changes
            w = await c.set_phase("weight-sync", request_id="w-1")
            assert w.epoch == 2 and c.address == a.address
            assert (await ask(a.address))[0] == grpc.StatusCode.OK
            assert (await ask(b.address))[2] == a.address
            want = {Circuit(x.ocs, x.a, x.b) for x in w.circuits}
            assert table(sim) == want

        etcd3.kill(next(i for i in range(3) if i != follower))  # two of three: no quorum
        async with AsyncClient(addresses, timeout_s=10) as c:
            with pytest.raises(errors.Unavailable) as lost:
                await c.set_phase("generation", request_id="g-1")
        assert "not the leader" in str(lost.value) or "no quorum" in str(lost.value)
        assert table(sim) == want  # no partial state on the switch

        for i in range(3):
            if not etcd3.members[i].running:
                etcd3.restart(i)
        await etcd3.wait_healthy()
        async with AsyncClient(addresses, timeout_s=40) as c:
            r = await c.set_phase("generation", request_id="g-1")
            assert r.epoch == 3 and r.phase == "generation"
            assert table(sim) == {Circuit(x.ocs, x.a, x.b) for x in r.circuits}
        assert await committed(etcd3) == [
            (1, "training", "t-1"),
            (2, "weight-sync", "w-1"),
            (3, "generation", "g-1"),
        ]
        assert any(e.get("event") == "stepped_down" for e in g.log("a"))
    finally:
        await g.close()
