"""NetlinkNics against this machine's kernel (the counters and state sysfs shows), and
against a stand-in kernel that answers late."""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

import pytest

from node_agent import nics
from node_agent.nics import NetlinkNics
from tests.helpers import FakeClock

pytestmark = pytest.mark.component

SYSFS = Path("/sys/class/net")


def interfaces() -> list[str]:
    return sorted(p.name for p in SYSFS.iterdir() if (p / "statistics").is_dir())[:4]


def operstate(name: str) -> str:
    return (SYSFS / name / "operstate").read_text().strip()


def sysfs_bytes(name: str) -> tuple[int, int]:
    stats = SYSFS / name / "statistics"
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


@pytest.mark.skipif(not (SYSFS / "lo").exists(), reason="no loopback interface in sysfs")
async def test_counters_and_state_match_sysfs() -> None:
    names = interfaces()
    reader = NetlinkNics([(n, None) for n in names] + [("orl-missing0", None)])
    try:
        await reader.open()
        before = {n: sysfs_bytes(n) for n in names}
        samples = await reader.sample()
        after = {n: sysfs_bytes(n) for n in names}
        by_name = {s.name: s for s in samples}
        for n in names:  # counters only grow: the netlink reading lies between the two
            assert before[n][0] <= by_name[n].rx_bytes <= after[n][0], n
            assert before[n][1] <= by_name[n].tx_bytes <= after[n][1], n
            assert by_name[n].oper_up == (operstate(n) == "up"), n
        missing = by_name["orl-missing0"]
        assert (missing.oper_up, missing.rx_bytes, missing.tx_bytes) == (False, 0, 0)
        again = await reader.sample()  # a second reading gives rates (>= 0)
        assert all(s.rx_gbps >= 0 and s.tx_gbps >= 0 for s in again)
    finally:
        reader.close()


class LateKernel:
    """One end of a datagram socketpair standing in for rtnetlink: answers each stats dump
    request from the event loop (after ``send`` has returned), in two datagrams, with
    counters that grow by 1 GB per dump."""

    def __init__(self, ifindex: int, *, split: bool = True) -> None:
        self.agent, self.kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.agent.setblocking(False)
        self.ifindex = ifindex
        self.split = split
        self.dumps = 0
        asyncio.get_running_loop().add_reader(self.kernel, self._answer)

    def _answer(self) -> None:
        seq = struct.unpack_from("=IHHII", self.kernel.recv(64))[3]
        self.dumps += 1
        counters = struct.pack("=QQQQ", 0, 0, self.dumps * 10**9, 0) + b"\0" * 160
        stats = struct.pack("=BBHiI", 0, 0, 0, self.ifindex, 1)
        attr = struct.pack("=HH", 4 + len(counters), nics.IFLA_STATS_LINK_64) + counters
        body = stats + attr
        message = struct.pack("=IHHII", 16 + len(body), nics.RTM_NEWSTATS, 2, seq, 0) + body
        done = struct.pack("=IHHIIi", 20, nics.NLMSG_DONE, 2, seq, 0, 0)
        if not self.split:
            self.kernel.send(message + done)
            return
        self.kernel.send(message)
        asyncio.get_running_loop().call_soon(self.kernel.send, done)  # the rest comes later

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.kernel)
        self.agent.close()
        self.kernel.close()


async def test_a_dump_the_kernel_answers_late_is_awaited_and_readings_stay_ordered() -> None:
    clock = FakeClock(100.0)
    reader = NetlinkNics([("eth0", 100.0)], clock=clock)
    kernel = LateKernel(ifindex=2)
    reader._sock = kernel.agent  # the socket open() would have made
    reader._links = {"eth0": (2, True)}
    try:
        [first] = await reader.sample()
        assert (first.rx_bytes, first.rx_gbps, first.oper_up) == (10**9, 0.0, True)
        clock.now += 1.0
        # two readings at once: the second waits for the first (rates from ordered deltas)
        second, third = await asyncio.gather(reader.sample(), reader.sample())
        assert [s.rx_bytes for s in second + third] == [2 * 10**9, 3 * 10**9]
        assert second[0].rx_gbps == pytest.approx(8.0)  # 1 GB in the 1 s since the first
        assert third[0].rx_gbps == second[0].rx_gbps  # no time passed: the rate stands
        assert kernel.dumps == 3
    finally:
        kernel.close()


def link_notification(ifindex: int, name: str, up: bool) -> bytes:
    head = struct.pack("=BxHiII", 0, 1, ifindex, 0, 0)
    attrs = b""
    for kind, payload in (
        (nics.IFLA_IFNAME, name.encode() + b"\0"),
        (nics.IFLA_OPERSTATE, bytes([6 if up else 2])),
    ):
        length = 4 + len(payload)
        attrs += struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)
    body = head + attrs
    return struct.pack("=IHHII", 16 + len(body), nics.RTM_NEWLINK, 0, 0, 0) + body


async def test_a_reading_keeps_the_dump_and_link_state_of_when_it_was_taken() -> None:
    clock = FakeClock(100.0)
    reader = NetlinkNics([("eth0", 100.0)], clock=clock)
    kernel = LateKernel(ifindex=2, split=False)  # the whole answer in one datagram
    reader._sock = kernel.agent
    reader._links = {"eth0": (2, True)}
    events, notify = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    events.setblocking(False)
    reader._events = events
    try:
        first = await reader.read()
        assert isinstance(first.counters.args[0], bytes)  # type: ignore[attr-defined] # kept whole
        clock.now += 1.0
        second = await reader.read()
        notify.send(link_notification(2, "eth0", up=False))  # the link goes down after
        reader._drain_events()
        third = await reader.read()
        rates = nics.NicRates()
        samples = [rates.samples(r)[0] for r in (first, second, third)]
        assert [s.rx_bytes for s in samples] == [10**9, 2 * 10**9, 3 * 10**9]
        assert [s.oper_up for s in samples] == [True, True, False]
        assert samples[1].rx_gbps == pytest.approx(8.0)  # 1 GB in the 1 s between readings
        assert kernel.dumps == 3
    finally:
        events.close()
        notify.close()
        kernel.close()
