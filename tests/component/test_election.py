"""Leader election on real etcd: one leader, takeover after a resign, a crash or a
freeze, and fencing tokens that only grow."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from fabric_controller.election import Election
from fabric_controller.etcd_store import Etcd, EtcdStore, NotLeader
from orchestrrl import errors
from sim_backends.etcd_cluster import EtcdCluster

pytest_plugins = ["tests.etcd_fixtures"]
pytestmark = pytest.mark.component

TTL = 2
MARGIN = 4  # seconds beyond the TTL a takeover may take on a loaded 2-core machine
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def etcd(etcd1: EtcdCluster) -> AsyncIterator[Etcd]:
    conn = Etcd(etcd1.endpoints, call_timeout_s=0.5, deadline_s=2.0)
    try:
        yield conn
    finally:
        await conn.close()


async def test_two_candidates_one_leads_then_the_other_after_a_resign(etcd: Etcd) -> None:
    lost: list[str] = []
    a = Election(etcd, "a:1", ttl_s=TTL, on_lost=lost.append)
    b = Election(etcd, "b:1", ttl_s=TTL)
    async with a, b:
        first = asyncio.create_task(a.campaign())
        fence_a = await first
        second = asyncio.create_task(b.campaign())
        await asyncio.sleep(3 * TTL / 2)  # longer than a TTL: keepalives hold a's lease
        assert not second.done() and a.is_leader and not b.is_leader
        assert await b.leader() == ("a:1", fence_a.token) and a.fence == fence_a
        with pytest.raises(NotLeader, match="no election won"):
            _ = b.fence
        await a.close()  # resigns: revokes the lease, the key goes with it
        async with asyncio.timeout(MARGIN):
            fence_b = await second
        assert fence_b.token > fence_a.token and b.is_leader and not a.is_leader
        assert await a.leader_address() == "b:1"
        assert lost == []  # a resign is not a loss


@contextlib.contextmanager
def candidate(endpoints: list[str], address: str) -> Iterator[subprocess.Popen[str]]:
    """``tests.ha_candidate`` as a process, killed (and thawed) at the end."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.ha_candidate", ",".join(endpoints), address, str(TTL)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


async def first_line(proc: subprocess.Popen[str], prefix: str, timeout_s: float = 30) -> str:
    """The first line of ``proc``'s output that starts with ``prefix``."""
    assert proc.stdout is not None
    out = proc.stdout
    async with asyncio.timeout(timeout_s):
        while True:
            line = await asyncio.to_thread(out.readline)
            if not line:
                raise AssertionError(f"candidate exited ({proc.wait()}) before {prefix!r}")
            if line.startswith(prefix):
                return line.strip()


async def test_a_killed_leader_is_replaced_within_its_ttl(etcd1: EtcdCluster, etcd: Etcd) -> None:
    with candidate(etcd1.endpoints, "a:1") as proc:
        token_a = int((await first_line(proc, "leader")).split()[1])
        proc.kill()  # kill -9: no resign, the lease must expire
        proc.wait()
        async with Election(etcd, "b:1", ttl_s=TTL) as b:
            async with asyncio.timeout(TTL + MARGIN):
                fence = await b.campaign()
            assert fence.token > token_a


async def test_a_frozen_leader_loses_and_cannot_write(etcd1: EtcdCluster, etcd: Etcd) -> None:
    """SIGSTOP the leader for longer than its lease: a standby takes over with a larger
    token; resumed, the old leader says it lost and every write of it is refused."""
    with candidate(etcd1.endpoints, "a:1") as proc:
        token_a = int((await first_line(proc, "leader")).split()[1])
        await first_line(proc, "wrote")
        proc.send_signal(signal.SIGSTOP)
        async with Election(etcd, "b:1", ttl_s=TTL) as b:
            frozen_at = time.monotonic()
            async with asyncio.timeout(TTL + MARGIN):
                fence = await b.campaign()
            assert fence.token > token_a
            assert time.monotonic() - frozen_at >= 1  # a lease outlives a second (TTL 2 s)
            store = (await EtcdStore.open(etcd)).fenced(fence)
            await store.abandon()  # the new leader's first write: clear a's journal
            proc.send_signal(signal.SIGCONT)
            lost = await first_line(proc, "lost")
            assert "expired" in lost
            refused = await first_line(proc, "refused")
            assert "NotLeader" in refused and f"fencing token {token_a}" in refused
            assert "held by b:1" in refused or "not the leader" in refused
            assert await store.pending() is None  # nothing of a's after the takeover
            assert b.is_leader and await b.leader() == ("b:1", fence.token)
        assert proc.wait(timeout=10) == 0


async def test_bad_settings_are_refused(etcd: Etcd) -> None:
    with pytest.raises(errors.InvalidArgument, match="ttl_s"):
        Election(etcd, "a:1", ttl_s=0)
    with pytest.raises(errors.InvalidArgument, match="address"):
        Election(etcd, "")
    with pytest.raises(errors.FailedPrecondition, match="before start"):
        await Election(etcd, "a:1").campaign()


async def test_a_standby_sees_a_leader_that_stops_renewing_as_past_due(etcd: Etcd) -> None:
    """Issue 28: the standby's view of the leader's lease (two etcd reads). A leader whose
    keepalives stop (frozen, partitioned) is past due well before etcd ends its lease."""
    async with Election(etcd, "a:1", ttl_s=TTL) as a, Election(etcd, "b:1", ttl_s=TTL) as b:
        await a.campaign()
        standing = await b.leader_standing()
        assert standing is not None
        assert (standing.address, standing.past_due, standing.granted_s) == ("a:1", False, TTL)
        assert a._keepalive is not None
        a._keepalive.cancel()  # a stops renewing, as a frozen process does
        with contextlib.suppress(asyncio.CancelledError):
            await a._keepalive
        async with asyncio.timeout(TTL + MARGIN):
            while True:
                standing = await b.leader_standing()
                if standing is None or standing.past_due:
                    break
                await asyncio.sleep(0.05)
        # past due while the key still names a (or already gone: a slow machine)
        assert standing is None or (standing.address, standing.past_due) == ("a:1", True)
