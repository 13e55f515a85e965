"""NIC telemetry read from a fake sysfs tree in a temporary directory."""

from __future__ import annotations

import errno
import struct
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from node_agent import nics
from node_agent.nics import NicRates, NicSample, NicSpec, SysfsNics, parse_nic
from orchestrrl import errors, rtnl
from tests.helpers import FakeClock

pytestmark = pytest.mark.unit


def write_nic(
    root: Path, name: str, rx: int, tx: int, state: str = "up", speed: str | None = None
) -> None:
    stats = root / name / "statistics"
    stats.mkdir(parents=True, exist_ok=True)
    (stats / "rx_bytes").write_text(f"{rx}\n")
    (stats / "tx_bytes").write_text(f"{tx}\n")
    (root / name / "operstate").write_text(f"{state}\n")
    if speed is not None:
        (root / name / "speed").write_text(f"{speed}\n")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("eth0", ("eth0", None)), ("mlx5_0=400", ("mlx5_0", 400.0)), ("ib0=12.5", ("ib0", 12.5))],
)
def test_parse_nic(text: str, expected: tuple[str, float | None]) -> None:
    assert parse_nic(text) == expected


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("", "interface name"),
        ("a/b", "interface name"),
        ("x" * 16, "interface name"),
        ("eth0=fast", "GBPS"),
        ("eth0=0", "GBPS"),
        ("eth0=-5", "GBPS"),
    ],
)
def test_parse_nic_rejects(text: str, rule: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=rule) as info:
        parse_nic(text)
    assert str(info.value).startswith(f"--nic={text!r}")


async def test_inventory_speed_from_flag_or_sysfs(tmp_path: Path) -> None:
    write_nic(tmp_path, "eth0", 0, 0, speed="400000")
    write_nic(tmp_path, "veth0", 0, 0, speed="-1")
    nics = SysfsNics(
        [("eth0", None), ("eth1", 200.0), ("veth0", None), ("gone", None)], root=tmp_path
    )
    assert await nics.open() == [
        NicSpec("eth0", 400.0),
        NicSpec("eth1", 200.0),
        NicSpec("veth0", 0.0),
        NicSpec("gone", 0.0),
    ]
    assert nics.inventory()[0] == NicSpec("eth0", 400.0)


async def test_rates_come_from_counter_deltas(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    write_nic(tmp_path, "eth0", rx=1_000, tx=2_000)
    nics = SysfsNics([("eth0", 400.0)], root=tmp_path, clock=clock)
    assert await nics.sample() == [NicSample("eth0", 1_000, 2_000, 0.0, 0.0, True)]
    clock.now += 2.0
    write_nic(tmp_path, "eth0", rx=1_000 + 50_000_000_000, tx=2_000 + 25_000_000_000)
    [sample] = await nics.sample()
    assert sample.rx_gbps == pytest.approx(200.0)  # 50 GB in 2 s
    assert sample.tx_gbps == pytest.approx(100.0)
    assert sample.oper_up


async def test_counter_reset_gives_no_negative_rate(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    write_nic(tmp_path, "eth0", rx=10_000, tx=10_000)
    nics = SysfsNics([("eth0", None)], root=tmp_path, clock=clock)
    await nics.sample()
    clock.now += 1.0
    write_nic(tmp_path, "eth0", rx=5, tx=5, state="down")
    [sample] = await nics.sample()
    assert (sample.rx_gbps, sample.tx_gbps, sample.oper_up) == (0.0, 0.0, False)


async def test_same_instant_keeps_the_previous_rate(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    write_nic(tmp_path, "eth0", rx=0, tx=0)
    nics = SysfsNics([("eth0", None)], root=tmp_path, clock=clock)
    await nics.sample()
    clock.now += 1.0
    write_nic(tmp_path, "eth0", rx=125_000_000, tx=0)
    [first] = await nics.sample()
    [again] = await nics.sample()  # no time passed
    assert first.rx_gbps == again.rx_gbps == pytest.approx(1.0)


async def test_missing_nic_is_down_with_one_warning(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    write_nic(tmp_path, "eth0", rx=1, tx=1)
    nics = SysfsNics([("eth0", None), ("eth9", 400.0)], root=tmp_path, clock=clock)
    with capture_logs() as logs:
        samples = [await nics.sample() for _ in range(3)]
    assert all(s[1] == NicSample("eth9", 0, 0, 0.0, 0.0, False) for s in samples)
    assert all(s[0].oper_up for s in samples)
    warnings = [e for e in logs if e["event"] == "nic_missing"]
    assert len(warnings) == 1
    assert warnings[0]["nic"] == "eth9"
    assert warnings[0]["log_level"] == "warning"

    write_nic(tmp_path, "eth9", rx=7, tx=8)  # plugged back in
    with capture_logs() as logs:
        [_, sample] = await nics.sample()
    assert sample == NicSample("eth9", 7, 8, 0.0, 0.0, True)
    assert [e["event"] for e in logs] == ["nic_present"]


async def test_a_reading_decoded_later_gives_the_counters_and_time_it_was_taken(
    tmp_path: Path,
) -> None:
    clock = FakeClock(100.0)
    write_nic(tmp_path, "eth0", rx=0, tx=0)
    nics_ = SysfsNics([("eth0", None)], root=tmp_path, clock=clock)
    first = await nics_.read()
    clock.now += 2.0
    write_nic(tmp_path, "eth0", rx=250_000_000, tx=0)
    second = await nics_.read()
    clock.now += 5.0
    write_nic(tmp_path, "eth0", rx=10**12, tx=10**12, state="down")  # after both readings
    rates = NicRates()
    assert rates.samples(first) == [NicSample("eth0", 0, 0, 0.0, 0.0, True)]
    [sample] = rates.samples(second)
    assert (sample.rx_bytes, sample.oper_up) == (250_000_000, True)
    assert sample.rx_gbps == pytest.approx(1.0)  # 250 MB in the 2 s between the readings


async def test_each_consumer_has_rates_of_its_own(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    write_nic(tmp_path, "eth0", rx=0, tx=0)
    nics_ = SysfsNics([("eth0", None)], root=tmp_path, clock=clock)
    readings = []
    for n in range(1, 4):
        readings.append(await nics_.read())
        clock.now += 1.0
        write_nic(tmp_path, "eth0", rx=n * 125_000_000, tx=0)
    every, odd = NicRates(), NicRates()
    assert [every.samples(r)[0].rx_gbps for r in readings] == pytest.approx([0.0, 1.0, 1.0])
    # another consumer that saw only the 1st and 3rd: rates over its own 2 s
    assert [odd.samples(r)[0].rx_gbps for r in readings[::2]] == pytest.approx([0.0, 1.0])


# -- rtnetlink parsing (messages built here as the kernel lays them out) ---------------------


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(kind: int, seq: int, payload: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(payload), kind, 2, seq, 0) + payload


def _stats_message(seq: int, ifindex: int, rx: int, tx: int) -> bytes:
    stats64 = struct.pack("=QQQQ", 10, 20, rx, tx) + b"\0" * (24 * 8 - 32)  # 24 u64s in all
    head = struct.pack("=BBHiI", 0, 0, 0, ifindex, 1)
    return _message(nics.RTM_NEWSTATS, seq, head + _attr(nics.IFLA_STATS_LINK_64, stats64))


def _link_message(kind: int, ifindex: int, name: str, oper: int) -> bytes:
    head = struct.pack("=BxHiII", 0, 1, ifindex, 0, 0)
    attrs = _attr(nics.IFLA_IFNAME, name.encode() + b"\0") + _attr(
        nics.IFLA_OPERSTATE, bytes([oper])
    )
    return _message(kind, 0, head + _attr(4, struct.pack("=I", 1500)) + attrs)


def test_stats_dump_datagram_gives_counters_per_ifindex() -> None:
    done = _message(nics.NLMSG_DONE, 7, struct.pack("=i", 0))
    data = _stats_message(7, 2, 1000, 2000) + _stats_message(7, 5, 2**64 - 1, 0) + done
    out: dict[int, tuple[int, int]] = {}
    assert nics.read_stats_datagram(data, len(data), 7, out) is True
    assert out == {2: (1000, 2000), 5: (2**64 - 1, 0)}


def test_stats_of_another_dump_are_ignored_and_a_datagram_may_not_end_it() -> None:
    data = _stats_message(6, 2, 1, 1) + _stats_message(7, 3, 5, 6)  # 6: an older dump
    out: dict[int, tuple[int, int]] = {}
    assert nics.read_stats_datagram(data, len(data), 7, out) is False
    assert out == {3: (5, 6)}


def test_a_stats_message_with_other_attributes_first_is_still_read() -> None:
    head = struct.pack("=BBHiI", 0, 0, 0, 9, 1)
    stats64 = struct.pack("=QQQQ", 0, 0, 77, 88) + b"\0" * 160
    payload = head + _attr(3, b"\0" * 8) + _attr(nics.IFLA_STATS_LINK_64, stats64)
    data = _message(nics.RTM_NEWSTATS, 1, payload)
    out: dict[int, tuple[int, int]] = {}
    nics.read_stats_datagram(data, len(data), 1, out)
    assert out == {9: (77, 88)}


def test_a_datagram_ends_a_dump_with_its_own_done_message() -> None:
    done = _message(nics.NLMSG_DONE, 7, struct.pack("=i", 0))
    stats = _stats_message(7, 2, 1000, 2000)
    assert nics.ends_dump(stats + done, len(stats + done), 7)
    assert nics.ends_dump(done, len(done), 7)
    assert not nics.ends_dump(stats + done, len(stats + done), 8)  # another dump's end
    assert not nics.ends_dump(stats, len(stats), 7)  # more datagrams to come
    error = _message(nics.NLMSG_ERROR, 7, struct.pack("=i", -errno.EPERM) + b"\0" * 16)
    assert not nics.ends_dump(error, len(error), 7)
    assert not nics.ends_dump(done, len(done) - 1, 7)


def test_a_netlink_error_answer_raises() -> None:
    data = _message(nics.NLMSG_ERROR, 3, struct.pack("=i", -errno.EPERM) + b"\0" * 16)
    with pytest.raises(OSError, match="rtnetlink") as info:
        nics.read_stats_datagram(data, len(data), 3, {})
    assert info.value.errno == errno.EPERM


def test_truncated_messages_are_not_read_past_the_datagram() -> None:
    data = _stats_message(1, 2, 3, 4)
    assert list(rtnl.frames(data, len(data) - 1)) == []
    assert list(rtnl.frames(b"\x04\0\0\0" + bytes(12), 16)) == []  # a length below the header's


def test_link_messages_give_index_name_and_oper_state() -> None:
    up = _link_message(nics.RTM_NEWLINK, 4, "eth0", nics.IF_OPER_UP)
    down = _link_message(nics.RTM_NEWLINK, 5, "eth1", 2)  # IF_OPER_DOWN
    data = up + down
    links = [nics.parse_link(data, start, end) for _, start, end in rtnl.frames(data, len(data))]
    assert links == [nics.LinkInfo(4, "eth0", True), nics.LinkInfo(5, "eth1", False)]


def test_requests_ask_for_a_dump_of_64_bit_stats_only() -> None:
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", nics.stats_dump_request(9))
    assert (kind, seq, length) == (nics.RTM_GETSTATS, 9, 28)
    assert flags & nics.NLM_F_DUMP == nics.NLM_F_DUMP
    assert struct.unpack_from("=BBHiI", nics.stats_dump_request(9), 16)[4] == 1  # LINK_64 only
    assert struct.unpack_from("=IH", nics.link_dump_request(1))[1] == nics.RTM_GETLINK


def test_a_run_of_stats_messages_reads_like_one_message_at_a_time() -> None:
    done = _message(nics.NLMSG_DONE, 7, struct.pack("=i", 0))
    run = b"".join(_stats_message(7, i, 1000 * i, 2**64 - i) for i in range(1, 21))
    out: dict[int, tuple[int, int]] = {}
    assert nics.read_stats_datagram(run + done, len(run + done), 7, out) is True
    parsed = {}
    for header, start, end in rtnl.frames(run, len(run)):
        assert header.type == nics.RTM_NEWSTATS
        index, rx, tx = nics.parse_stats(run, start, end) or (0, 0, 0)
        parsed[index] = (rx, tx)
    assert out == parsed and len(out) == 20


def test_a_run_broken_by_other_messages_reads_every_message() -> None:
    head = struct.pack("=BBHiI", 0, 0, 0, 9, 1)
    stats64 = struct.pack("=QQQQ", 0, 0, 77, 88) + b"\0" * 160
    longer = _message(nics.RTM_NEWSTATS, 7, head + _attr(3, b"\0" * 8) + _attr(1, stats64))
    data = (
        _stats_message(7, 2, 1, 2)
        + _stats_message(6, 3, 3, 4)  # an older dump's
        + _stats_message(7, 4, 5, 6)
        + longer  # another length: other attributes first
        + _stats_message(7, 5, 7, 8)
    )
    out: dict[int, tuple[int, int]] = {}
    assert nics.read_stats_datagram(data, len(data), 7, out) is False
    assert out == {2: (1, 2), 4: (5, 6), 9: (77, 88), 5: (7, 8)}
    assert nics.read_stats_datagram(data, len(data) - 1, 7, {}) is False  # cut short: no error
