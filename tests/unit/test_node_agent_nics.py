"""NIC telemetry read from a fake sysfs tree in a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from node_agent.nics import NicSample, NicSpec, SysfsNics, parse_nic
from orchestrrl import errors
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
